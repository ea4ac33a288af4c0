"""The simulated copy backend, and the real worker built over it.

`TagCopier` is a `kernels.BlockCopier` like the byte-moving backends, driven by the connector's real worker
(`worker.side.OffloadWorker` and its `TransferEngine`), but it moves *tags* instead of KV bytes: `gpu[block]` and
`host[slot]` hold the tag (group, block hash) of the tokens whose KV the block or slot holds. The driver writes the
tags of every block a step computes (`sim.driver`); a store copies its GPU blocks' tags to its host slots, a load
copies its host slots' tags into its GPU blocks, and when a load lands the driver checks that every block of the
request's restore range holds the tag of its own tokens. Nothing is allocated: `build_worker` registers meta-device
KV caches and a meta-device host tier, so a 40 GiB tier over 2,188 blocks of 2.5 MiB costs nothing.

A copy is issued when the worker calls `copy()` and lands when the simulation reaches its due time (`advance`): a
fixed number of steps after the step that issued it (`StepTiming`, per direction), or when its bytes have crossed a
simulated link (replay's `ClockTiming`). Until then `query()` is false, as for a CUDA copy still running. A host
`wait()` (the worker waiting for a fenced store, or for a store that still reads a load's destination blocks) reads
the copy's source at once, as the real copy has by the time the wait returns, and takes no simulated time: the copy
still lands, and is reported, at its due time. Fault injection: a job may fail (`fail_store` / `fail_load`, decided
when it is issued): it writes nothing and lands with `Completion.error` set, which the worker reports like a copy
that failed (`stores_failed`, `failed_recving`); a held job (`hold_loads` / `hold_stores`, `hold`) stays in flight
until `release`.

The copier sees per-group (host slot, GPU block) ids, not jobs. Fault injection and holds are decided per job, so the
driver hands it each step's jobs (`expect`) before the worker issues them: the worker issues a step's stores, then
its loads, in the metadata's order, and each copy is checked against the job it is taken for. A load that first
reads blocks back into the CPU tier (disk or shared tier: `TransferJob.reads`) is issued later, once they
are back (the worker's `land_reads`); its copy is matched to it by its (slot, block) pairs then.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

import numpy as np
import torch

from offload_connector.kernels.api import BlockCopier, Completion, TensorLayout, _check_page_view
from offload_connector.metadata import OffloadMetadata, TransferJob

HELD = 1 << 60  # due time of a held job


class StepTiming:
    """Jobs land `load_latency` / `store_latency` steps after the step that issued them."""

    def __init__(self, load_latency: int = 1, store_latency: int = 1) -> None:
        self.load_latency = load_latency
        self.store_latency = store_latency

    def due(self, job: TransferJob, is_load: bool, step: int, not_before: float = 0.0) -> float:
        return max(step + (self.load_latency if is_load else self.store_latency), not_before)

    def now(self, step: int) -> float:
        return step

    def time_at(self, step: int) -> float:
        return step

    def seconds(self, job: TransferJob, is_load: bool) -> float:
        return self.load_latency if is_load else self.store_latency

    def forward_waits_until(self, due: float) -> None:
        """A forward pass waits for a load due then (load_completion "ordered"); steps take no time here."""


@dataclass
class TagOp:
    """One issued copy: its job, when it lands, and the (host slot, GPU block) pairs it was given."""
    due: float
    job: TransferJob
    is_load: bool
    pairs: list[tuple[int, int]]
    failed: bool = False
    captured: list[Hashable] | None = None  # a store's source tags, read early by a host wait
    landed: bool = False
    # A load landed before its due time because something was ordered after it: its tags are in place, but its
    # copy is still running until the simulation reaches `due` (query() is false until then).
    early: bool = False
    forward_ordered: bool = False  # a forward pass was ordered after it (the worker's host wait, before a forward)
    step: int = 0  # the step that issued it
    # A store's source blocks that a later write of the same step replaced after the copy had read them (vLLM's
    # state copy after sampling): block -> the tag the copy read.
    read_before: dict[int, Hashable] | None = None


class TagCompletion(Completion):
    def __init__(self, copier: "TagCopier", op: TagOp) -> None:
        super().__init__(None)
        self._copier = copier
        self.op = op

    def query(self) -> bool:
        return self.op.landed and not self.op.early

    def wait(self) -> None:
        # The worker waits on the host for a store (it has read its source by then) or, before a forward pass, for an
        # ordered load: the forward starts when the load lands (`forward_waits_until`).
        if self.op.is_load:
            self._copier._land_early(self.op)
            self.op.forward_ordered = True
            self._copier.timing_forward_wait(self.op)
        else:
            self._copier._read_source(self.op)

    def order_before(self, stream: Any) -> None:
        # No streams here. A store: read its source now, as the worker's host wait for a copy not issued yet. A load
        # (an ordered or timed-out one, before a later copy): that copy starts only once this one has landed.
        if self.op.is_load:
            self._copier._land_early(self.op)
            if self.op.due != HELD:
                self._copier.copy_floor = max(self._copier.copy_floor, self.op.due)
        else:
            self.wait()

    @property
    def started(self) -> bool:
        """A held copy has not started: the worker cannot expect it to land, and reports it once it has."""
        return self.op.due != HELD

    def device_seconds(self) -> float | None:
        """The copy's own time on the simulated link (what CUDA timing events around it measure)."""
        return self._copier.timing_seconds(self.op)

    @property
    def error(self) -> str | None:  # type: ignore[override]
        # Decided when the copy is issued; the worker reads it once the copy has landed, or at once when it reports
        # loads when issued (load_completion "ordered"). A failure known at issue is a copy that writes nothing and
        # that the worker stops waiting for: read early, it lands now, so it is not left in flight once the worker
        # and the scheduler have let go of the load (the lifecycle property test's drained check found one).
        if not self.op.failed:
            return None
        self._copier._land_early(self.op)
        return "injected failure (simulated backend)"


class TagCopier(BlockCopier):
    """Simulated copy backend (see the module doc). `load_latency` / `store_latency` (steps; store defaults to load)
    or `timing` decide when a copy lands; `fail_store(job)` / `fail_load(job)` whether it fails; `hold_loads` /
    `hold_stores` hold every job of that direction issued from now on until `release`. `log_jobs`: keep every landed
    job in `completed` (tests; off for hour-long runs)."""

    name = "sim-tags"

    def __init__(self, load_latency: int = 1, store_latency: int | None = None, *,
                 timing: Any = None,
                 fail_store: Callable[[TransferJob], bool] | None = None,
                 fail_load: Callable[[TransferJob], bool] | None = None,
                 hold_loads: bool = False, hold_stores: bool = False, log_jobs: bool = True) -> None:
        # Not BlockCopier.__init__: the layout comes later, from the worker (`bind`), as meta-device views.
        self.timing = timing or StepTiming(load_latency, load_latency if store_latency is None else store_latency)
        self.fail_store = fail_store
        self.fail_load = fail_load
        self.hold_loads = hold_loads
        self.hold_stores = hold_stores
        self.log_jobs = log_jobs
        self.layouts: list[TensorLayout] = []
        self.segments: list[list[int]] = []
        self.device = torch.device("meta")
        self.gpu: dict[int, Hashable] = {}
        self.host: dict[int, Hashable] = {}
        self.inflight: deque[TagOp] = deque()  # issued, not landed, in issue order
        self.loads_done = 0
        self.stores_done = 0
        self.loads_failed = 0
        self.stores_failed = 0
        self.fenced = 0
        self.completed: list[tuple[float, str, TransferJob, bool]] = []  # (landed at, kind, job, ok)
        self._step = 0
        self._expected: dict[str, deque[TransferJob]] = {"d2h": deque(), "h2d": deque()}
        self._read_back: list[TransferJob] = []  # loads issued once their disk / shared-tier reads are back
        self._refused: list[str] = []
        # A copy the worker ordered after an unlanded load starts no earlier than that load's due time.
        self.copy_floor = 0.0
        self._early: list[TagOp] = []  # loads landed before their due time (`_land_early`)

    # ----------------------------------------------------------------- layout
    def bind(self, device_pages: Sequence[torch.Tensor], host_pages: Sequence[torch.Tensor],
             segments: Sequence[Sequence[int]]) -> "TagCopier":
        """Take the worker's page views (meta-device tensors: only their shapes are read) and segments; this is
        the copier factory the worker calls (`build_worker`)."""
        if len(device_pages) != len(host_pages):
            raise ValueError(f"device_pages has {len(device_pages)} tensors but host_pages has {len(host_pages)}")
        layouts = []
        for t, (d, h) in enumerate(zip(device_pages, host_pages)):
            _check_page_view(d, f"device_pages[{t}]")
            _check_page_view(h, f"host_pages[{t}]")
            layouts.append(TensorLayout(page_bytes=int(d.shape[1]), device_blocks=int(d.shape[0]),
                                        host_blocks=int(h.shape[0]), device_stride=int(d.stride(0)),
                                        host_stride=int(h.stride(0))))
        self.layouts, self.segments = layouts, [[int(t) for t in seg] for seg in segments]
        self.device_pages, self.host_pages = list(device_pages), list(host_pages)
        return self

    # ------------------------------------------------------------------- jobs
    def expect(self, meta: OffloadMetadata, step: int) -> None:
        """The jobs the worker is about to issue for this step (its stores, then its loads, in this order)."""
        self._step = step
        # A load that reads blocks back from the disk or shared tier first is issued later, when they are all back
        # (the worker's `land_reads`): it is matched by its (slot, block) pairs then.
        now = [j for j in meta.loads if not j.reads]
        self._read_back.extend(j for j in meta.loads if j.reads)
        # Stores marked `after_sampling` are issued from wait_for_save, after the step's other stores.
        self._expected = {"d2h": deque(sorted(meta.stores, key=lambda j: j.after_sampling)), "h2d": deque(now)}
        if meta.store_fences:
            self.fenced += len(set(meta.store_fences))

    def check_issued(self, sampled: bool = True) -> None:
        """After the worker's `start` (`sampled` False: the stores it issues after sampling may wait) or its
        `after_sampling`: every job was issued, as the copy it stands for. The worker reports a copy that raised as
        a failed job and serves on, so a copy this backend refused is raised here instead."""
        refused, self._refused = self._refused, []
        if refused:
            raise AssertionError("; ".join(refused))
        left = [j.job_id for q in self._expected.values() for j in q if sampled or not j.after_sampling]
        if left:
            raise AssertionError(f"the worker did not issue jobs {left} of step {self._step}")

    def copy(self, direction: Any, ids: Sequence[object], stream: Any = None) -> Completion:
        try:
            return super().copy(direction, ids, stream)  # the real backends' id checks, then `_copy`
        except Exception as exc:
            self._refused.append(f"step {self._step}: {direction} copy refused: {exc}")
            raise

    def _copy(self, direction: str, ids: list[tuple[np.ndarray, np.ndarray] | None], stream: Any) -> Completion:
        queue = self._expected[direction]
        pairs = [(int(h), int(d)) for entry in ids if entry is not None for h, d in zip(entry[0], entry[1])]
        if not queue and direction == "h2d" and self._read_back:
            want = Counter(pairs)
            match = next((j for j in self._read_back if Counter(zip(j.host_slots, j.gpu_blocks)) == want), None)
            if match is None:
                raise AssertionError(f"the worker issued a load copy {sorted(pairs)} that no job explains")
            self._read_back.remove(match)
            queue = deque([match])
        if not queue:
            raise AssertionError(f"the worker issued a {direction} copy that no job explains")
        job = queue.popleft()
        if Counter(pairs) != Counter(zip(job.host_slots, job.gpu_blocks)):
            raise AssertionError(f"the copy for job {job.job_id} moves {sorted(pairs)}, the job "
                                 f"{sorted(zip(job.host_slots, job.gpu_blocks))}")
        is_load = direction == "h2d"
        predicate = self.fail_load if is_load else self.fail_store
        failed = predicate is not None and bool(predicate(job))
        held = self.hold_loads if is_load else self.hold_stores
        due = HELD if held else self.timing.due(job, is_load, self._step, self.copy_floor)
        op = TagOp(due, job, is_load, pairs, failed, step=self._step)
        self.inflight.append(op)
        return TagCompletion(self, op)

    def _land_early(self, op: TagOp) -> None:
        """Land a load now that something is ordered after it (a later copy, a forward pass): its destination blocks
        hold their tags from here on, whatever the due time; the time that costs is charged by the caller."""
        if op.landed or op.due == HELD:
            return
        self._land(op, self.timing.now(self._step))
        self.inflight = deque(o for o in self.inflight if o is not op)
        op.early = True
        self._early.append(op)

    def clock(self) -> float:
        """The simulation's time now, for the worker's transfer engine (steps, or simulated seconds)."""
        return self.timing.time_at(self._step)

    def timing_seconds(self, op: TagOp) -> float | None:
        seconds = getattr(self.timing, "seconds", None)
        return seconds(op.job, op.is_load) if seconds is not None else None

    def timing_forward_wait(self, op: TagOp) -> None:
        if op.due != HELD:
            self.timing.forward_waits_until(op.due)

    def _read_source(self, op: TagOp) -> None:
        """A host wait: the copy has read its source by the time it returns (a store's GPU blocks)."""
        if not op.landed and not op.is_load and op.captured is None:
            op.captured = [self.gpu.get(b) for _, b in op.pairs]

    def overwrite_after_reads(self, block: int, tag: Hashable) -> None:
        """A write to `block` later in this step than the stores this step has issued so far: they read the block
        before it (a store issued after the forward and before vLLM's state copy)."""
        for op in self.inflight:
            if op.step == self._step and not op.is_load and not op.landed and op.captured is None:
                if any(b == block for _, b in op.pairs):
                    if op.read_before is None:
                        op.read_before = {}
                    op.read_before.setdefault(block, self.gpu.get(block))
        self.gpu[block] = tag

    # ---------------------------------------------------------------- landing
    def advance(self, step: int) -> None:
        """Land every copy due by the simulation's time at `step` (the timing's `now`), in issue order."""
        now = self.timing.now(step)
        for op in self._early:
            if op.due <= now:
                op.early = False
        self._early = [op for op in self._early if op.early]
        still: deque[TagOp] = deque()
        for op in self.inflight:
            if op.due > now:
                still.append(op)
            else:
                self._land(op, now)
        self.inflight = still

    def _land(self, op: TagOp, now: float) -> None:
        if op.failed:  # writes nothing
            if op.is_load:
                self.loads_failed += 1
            else:
                self.stores_failed += 1
        elif op.is_load:
            for slot, block in op.pairs:
                self.gpu[block] = self.host.get(slot)
            self.loads_done += 1
        else:
            before = op.read_before or {}
            data = op.captured or [before[b] if b in before else self.gpu.get(b) for _, b in op.pairs]
            for tag, (slot, _) in zip(data, op.pairs):
                self.host[slot] = tag
            self.stores_done += 1
        op.landed = True
        if self.log_jobs:
            self.completed.append((now, "load" if op.is_load else "store", op.job, not op.failed))

    # ---------------------------------------------------------------- control
    def hold(self, job_ids: set[int]) -> None:
        for op in self.inflight:
            if op.job.job_id in job_ids:
                op.due = HELD

    def release(self, step: int, kind: str | None = None) -> None:
        """Held jobs (of `kind`, or all) land at the next `advance` at or after `step`."""
        if kind in (None, "load"):
            self.hold_loads = False
        if kind in (None, "store"):
            self.hold_stores = False
        for op in self.inflight:
            if op.due == HELD and (kind is None or (kind == "load") == op.is_load):
                op.due = step

    def unsettled_loads(self) -> dict[str, TagOp]:
        """Loads whose copies are still running (not landed, or landed early), by request."""
        return {op.job.request_id: op for op in (*self.inflight, *self._early) if op.is_load}

    def inflight_jobs(self, kind: str | None = None, request_id: str | None = None) -> list[TransferJob]:
        return [op.job for op in self.inflight
                if (kind is None or (kind == "load") == op.is_load)
                and (request_id is None or op.job.request_id == request_id)]


# ------------------------------------------------------------------------------------------- the worker
@dataclass
class MetaHostTier:
    """A host tier that is never allocated: a meta-device (num_slots, slot_bytes) arena."""
    tensor: torch.Tensor
    pinned: bool = False


def meta_host_tier(num_slots: int, slot_bytes: int, pin: bool) -> MetaHostTier:
    return MetaHostTier(torch.empty((num_slots, slot_bytes), dtype=torch.uint8, device="meta"))


def meta_kv_caches(kv_cache_config: Any) -> dict[str, torch.Tensor]:
    """One (num_blocks, page_bytes) meta-device KV cache per layer of every group, each its own range of one meta
    arena (meta tensors have no memory, but distinct offsets, which the worker's layout tells pages apart by)."""
    num_blocks = int(kv_cache_config.num_blocks)
    pages: list[tuple[str, int]] = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        per_layer = getattr(spec, "kv_cache_specs", None) or {}
        for name in group.layer_names:
            pages.append((name, int((per_layer.get(name) or spec).page_size_bytes)))
    arena = torch.empty(num_blocks * sum(p for _, p in pages), dtype=torch.uint8, device="meta")
    caches: dict[str, torch.Tensor] = {}
    offset = 0
    for name, page in pages:
        caches[name] = arena[offset:offset + num_blocks * page].view(num_blocks, page)
        offset += num_blocks * page
    return caches


def build_worker(copier: TagCopier, scheduler: Any) -> Any:
    """The connector's real worker side for `scheduler`'s KV cache, over `copier`, with nothing allocated.

    Its config is the scheduler-side connector's, without the load deadline (`load_timeout_s` is wall-clock time,
    which means nothing here; a simulated copy lands when the simulation says)."""
    from offload_connector.worker.side import OffloadWorker

    conn = scheduler.get_kv_connector()
    config = dataclasses.replace(conn.offload_config, load_timeout_s=0.0)
    kv_cache_config = scheduler.kv_cache_config
    worker = OffloadWorker(config, scheduler.vllm_config, kv_cache_config,
                           copier_factory=lambda backend, device_pages, host_pages, segments, *, device:
                           copier.bind(device_pages, host_pages, segments),
                           host_tier_factory=meta_host_tier, clock=copier.clock)
    worker.register_kv_caches(meta_kv_caches(kv_cache_config))
    side = getattr(conn, "scheduler_side", None)
    if side is not None and worker.host_tier.tensor.shape[0] != side.tier.capacity_slots:
        raise AssertionError(f"worker host tier has {worker.host_tier.tensor.shape[0]} slots, the scheduler side "
                             f"{side.tier.capacity_slots}")
    return worker
