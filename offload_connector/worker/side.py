"""Worker side of the connector: the host tier, the copies, and what each step reports back.

Per step vLLM calls (see `kv_connector_model_runner_mixin`): `handle_preemptions(meta)` before the forward pass,
where stores that the scheduler fenced (their source blocks are reused by this forward) are waited for and the
forward is ordered after the loads it fenced (reported before they landed: load_completion "ordered");
`start_load_kv` after the forward launch, where this step's stores and loads are issued; then `get_finished` /
`get_transfer_results`, the stats and the worker metadata (store jobs that finished). A request that finished with
stores still in flight is reported in `finished_sending` once none of its stores is pending, which is when vLLM
frees its blocks.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Callable, Protocol

import torch

from offload_connector.config import ConfigError, OffloadConfig, check_host_memory
from offload_connector.groups import tier_slots
from offload_connector.log import get_logger
from offload_connector.metadata import OffloadMetadata, OffloadWorkerMetadata, TransferJob
from offload_connector.metrics import OffloadStats, OffloadStatsSink, counts_blocks_here
from offload_connector.second_tiers import tier_metrics
from offload_connector.worker.faults import install_faults
from offload_connector.worker.layout import KVLayout, build_layout, host_views
from offload_connector.worker.second_tier import ReadHandle, WorkerSecondTier
from offload_connector.worker.transfers import Copier, TransferEngine

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from offload_connector.kernels import HostTier

logger = get_logger(__name__)


class HostTierLike(Protocol):
    """The host tier: `tensor`, a (num_slots, slot_bytes) uint8 arena, and optionally `pinned` and `close()`
    (kernels.HostTier; the benchmarks' simulation passes a meta-device one)."""

    @property
    def tensor(self) -> torch.Tensor: ...


# make_copier's signature: (transfer_backend, device_pages, host_pages, segments, *, device) -> a kernels.BlockCopier.
CopierFactory = Callable[..., Copier]
# (num_slots, slot_bytes, pin) -> the host tier.
HostTierFactory = Callable[[int, int, bool], HostTierLike]


def allocate_checked_host_tier(num_slots: int, slot_bytes: int, pin: bool) -> HostTier:
    """The host tier vLLM's workers get: checked against the host's memory first, then allocated (pinned on CUDA)."""
    from offload_connector.kernels import allocate_host_tier

    # Before the mmap: a tier the host cannot hold is one ConfigError naming 'cpu_bytes', not a bare OSError.
    check_host_memory(num_slots * slot_bytes)
    try:
        return allocate_host_tier(num_slots, slot_bytes, pin=pin)
    except OSError as err:  # the kernel refused the mapping all the same (ENOMEM under strict overcommit)
        raise ConfigError(f"kv_connector_extra_config: 'cpu_bytes': the host refused the "
                          f"{num_slots * slot_bytes:,}-byte host tier ({err}); lower 'cpu_bytes'") from None


def worker_rank() -> int:
    """This worker's rank among the engine's workers: pp_rank x tensor_parallel_size + tp_rank (vLLM's order)."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    tp = get_tp_group()
    return get_pp_group().rank_in_group * tp.world_size + tp.rank_in_group


class OffloadWorker:
    """The worker side. `copier_factory` and `host_tier_factory` replace how the copier and the host tier are built
    (default: `kernels.make_copier` and `allocate_checked_host_tier`); the benchmarks' simulation passes a simulated
    copier and a meta-device tier, and registers meta-device KV caches, so the worker runs as it does in vLLM
    without a byte of KV cache or host tier being allocated, and `clock` (simulated time) for the transfer engine's
    estimate of when loads land."""

    def __init__(self, config: OffloadConfig, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, *,
                 copier_factory: CopierFactory | None = None,
                 host_tier_factory: HostTierFactory | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.config = config
        self._vllm_config = vllm_config
        self._copier_factory = copier_factory
        self._host_tier_factory = host_tier_factory or allocate_checked_host_tier
        self._clock = clock  # the transfer engine's time source (default: the host's; a simulation's own)
        self.kv_cache_config = kv_cache_config
        self.stats = OffloadStatsSink()
        self.layout: KVLayout | None = None
        self.engine: TransferEngine | None = None
        self.host_tier: HostTierLike | None = None
        self.backend: str | None = None
        self._count_blocks = True
        self._fenced_step = -1
        self._store_owner: dict[int, str] = {}  # pending store job -> request
        self._stores_of: dict[str, set[int]] = {}  # request -> its pending store jobs
        self._delayed: set[str] = set()  # finished requests whose blocks wait for their stores
        self._after_sampling: list[TransferJob] = []  # this step's stores issued from wait_for_save
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._stores_done: list[int] = []
        self._stores_failed: list[int] = []
        self._landed: list[tuple[str, bool]] = []  # loads polled since the last report: (request, ok)
        self.num_slots = 0
        # The second tiers this worker opened (disk, shared), by their names in the step messages.
        self.second_tiers: dict[str, WorkerSecondTier] = {}
        # Loads waiting for their blocks to come back from disk or the shared tier: (job, completion handles).
        self._reading: list[tuple[TransferJob, list[ReadHandle], float]] = []  # (job, read handles, started)
        # Reads of loads failed by load_timeout_s that have not returned: they may still write their CPU-tier slots.
        self._abandoned: list[tuple[TransferJob, list[ReadHandle]]] = []
        self._reads_abandoned: list[int] = []
        self._reads_settled: list[int] = []
        self._writes_done: dict[str, list[int]] = {}
        self._writes_failed: dict[str, list[int]] = {}
        # The debug section's fault injection and test delays (worker/faults.py): None unless it turns one on, and
        # then they wrap the transfer engine and the load reports.
        self.faults = install_faults(config.debug, worker_rank)

    # ------------------------------------------------------------------ set-up
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from offload_connector.kernels import make_copier

        layout, views = build_layout(kv_caches, self.kv_cache_config)
        # The scheduler side's slot count, from the same function: slot ids it hands out exist here.
        num_slots, tier_slot_bytes = tier_slots(self.config.cpu_bytes, self.kv_cache_config)
        device = views[0].device
        self.host_tier = self._host_tier_factory(num_slots, layout.slot_bytes, device.type == "cuda")
        self.num_slots = num_slots
        self._open_second_tiers(layout, tier_slot_bytes)
        hosts = host_views(self.host_tier.tensor, layout)
        copier = (self._copier_factory or make_copier)(self.config.transfer_backend, views, hosts, layout.segments,
                                                       device=device)
        self.backend = getattr(copier, "name", type(copier).__name__)
        self.layout = layout
        checksums = None
        if self.config.verify_loads:
            from offload_connector.worker.checksum import BlockChecksummer, SlotChecksums
            checksums = SlotChecksums(BlockChecksummer(views, layout.segments, [p.host_offset for p in layout.pages]),
                                      num_slots)
        engine: Callable[..., TransferEngine] = TransferEngine
        if self.faults is not None:
            engine = functools.partial(self.faults.transfer_engine, segments=layout.segments, views=views)
        self.engine = engine(copier, len(layout.group_bytes), layout.group_bytes, device,
                             load_timeout_s=self.config.load_timeout_s, checksums=checksums,
                             ordered_loads=self.config.load_completion == "ordered", clock=self._clock)
        self._count_blocks = counts_blocks_here()
        logger.info("offload_connector worker side: host tier %d bytes (cpu_bytes %d) = %d slots x %d bytes (%s, "
                    "%s), shared by %d KV cache groups (%s); %d unique KV pages in all; backend %s "
                    "(transfer_backend %s); load timeout %s",
                    num_slots * layout.slot_bytes, self.config.cpu_bytes, num_slots, layout.slot_bytes,
                    "pinned" if getattr(self.host_tier, "pinned", False) else "pageable", device.type,
                    len(layout.segments),
                    "; ".join(f"group {g}: {len(seg)} pages, {nbytes} bytes per block"
                              for g, (seg, nbytes) in enumerate(zip(layout.segments, layout.group_bytes))),
                    len(layout.pages), self.backend, self.config.transfer_backend,
                    f"{self.config.load_timeout_s:g} s" if self.config.load_timeout_s else "off")

    def _open_second_tiers(self, layout: KVLayout, tier_slot_bytes: int) -> None:
        """The second tiers the config turns on (`second_tiers.py`, in read order), keyed by a fingerprint of this
        worker's own shard (model, its blocks' bytes and layers, KV dtype, its TP/PP position)."""
        from offload_connector.second_tiers import SECOND_TIERS, tier_factory
        from offload_connector.worker.second_tier import ClientContext
        ctx = ClientContext(self.config, self.host_tier.tensor, tuple(layout.group_bytes), layout.slot_bytes,
                            tier_slot_bytes, self._vllm_config, self.kv_cache_config)
        for name in SECOND_TIERS:
            client = tier_factory(name, "worker")(ctx)
            if client is not None:
                self.second_tiers[client.name] = client

    # -------------------------------------------------------------- per step
    def fence(self, meta: OffloadMetadata) -> None:
        """Before the forward pass: finish reading blocks this step's forward overwrites."""
        self.after_sampling()  # the fences may name them; a step's sampling is over before the next one's fence
        if self.engine is not None and self._fenced_step != meta.step:
            if meta.store_fences:
                self.engine.wait_for_jobs(meta.store_fences)
            self.engine.order_compute_after_zombies()
            # Loads reported before their copies landed (load_completion "ordered") whose blocks this forward may
            # read: named by the scheduler in the first step after it learned of them, ordered before every forward
            # from then on until they land.
            self.engine.order_compute_after_loads(meta.load_fences)
        self._fenced_step = meta.step

    def start(self, meta: OffloadMetadata) -> None:
        if self.engine is None:
            if meta.loads or meta.stores:
                raise RuntimeError("offload_connector: transfers requested before register_kv_caches")
            self._delayed.update(meta.delayed_free)
            return
        if meta.tier_slots > self.num_slots:
            # Under pipeline parallelism the scheduler sizes the tier from the first stage's blocks; a stage with
            # larger blocks has fewer slots, and a slot id past its tier would overwrite memory it does not own.
            raise RuntimeError(f"offload_connector: the scheduler hands out {meta.tier_slots} CPU-tier slots but this "
                               f"worker's tier has {self.num_slots} (its KV blocks are larger than the first "
                               f"pipeline stage's); raise 'cpu_bytes' or balance the pipeline stages")
        self.fence(meta)  # no-op when handle_preemptions already ran for this step
        for name, second in self.second_tiers.items():
            second.apply(meta.tier_step(name))
        for job in meta.stores:
            self._store_owner[job.job_id] = job.request_id
            self._stores_of.setdefault(job.request_id, set()).add(job.job_id)
            if job.after_sampling:
                self._after_sampling.append(job)
            else:
                self.engine.submit_store(job)
        for job in meta.loads:
            if job.reads:
                self._start_reads(job)  # copied to the GPU once its blocks are back in the CPU tier (land_reads)
            else:
                self.engine.submit_load(job)
        self._delayed.update(meta.delayed_free)

    def after_sampling(self) -> None:
        """vLLM's `wait_for_save`: issue the stores that read what this step's sampling copied (see
        `TransferJob.after_sampling`); the copy is on the compute stream, which the store waits for."""
        jobs, self._after_sampling = self._after_sampling, []
        if self.engine is not None:
            for job in jobs:
                self.engine.submit_store(job)

    def _collect(self) -> None:
        if self.engine is None:
            return
        self.land_reads()
        for name, second in self.second_tiers.items():
            done, failed = second.finished_writes()
            if done:
                self._writes_done.setdefault(name, []).extend(done)
            if failed:
                self._writes_failed.setdefault(name, []).extend(failed)
            metrics = tier_metrics(name)  # what the tier reports under, as its package declares
            self.stats.record_tier_io(metrics, *second.io_deltas())
            self.stats.record_rejections(metrics, "worker", second.rejected())
        timeouts_before = self.engine.timeouts
        results = self.engine.poll()
        for _ in range(self.engine.timeouts - timeouts_before):
            self.stats.record_load_timeout()
        for result in results:
            job = result.job
            self.stats.record_transfer(result.kind, job.num_blocks, result.nbytes, result.seconds, result.ok,
                                       count_blocks=self._count_blocks)
            if result.verify_failed:
                self.stats.record_load_verify_failure()
            if result.early:
                self.stats.record_load_reported_early()
            if result.kind == "load":
                self._landed.append((job.request_id, result.ok))
                continue
            (self._stores_done if result.ok else self._stores_failed).append(job.job_id)
            rid = self._store_owner.pop(job.job_id, job.request_id)
            pending = self._stores_of.get(rid)
            if pending is not None:
                pending.discard(job.job_id)
                if not pending:
                    del self._stores_of[rid]

    def _start_reads(self, job: TransferJob) -> None:
        handles: list[ReadHandle] = []
        missing = [read.tier for read in job.reads if read.tier not in self.second_tiers]
        if missing:  # the scheduler and this worker disagree on the tiers: fail the load, never copy a partial one
            assert self.engine is not None
            self.engine.submit_failed_load(job, f"this worker has no {missing[0]} tier")
            return
        # The reads write CPU-tier slots from the host: a slot the scheduler released when it was told of an ordered
        # load may still be read by that load's copy.
        assert self.engine is not None
        self.engine.wait_for_ordered_loads()
        for read in job.reads:
            handles += self.second_tiers[read.tier].read_back(read)
        self._reading.append((job, handles, time.monotonic()))

    def land_reads(self) -> None:
        """Loads whose disk or shared-tier reads have all finished go to the GPU now, or fail if any read failed
        (missing, corrupt, I/O error): the request recomputes, no partial prefix is ever copied."""
        assert self.engine is not None
        still = []
        now, limit = time.monotonic(), self.config.load_timeout_s
        for job, handles, started in self._reading:
            if not all(h.done() for h in handles):
                if limit > 0 and now - started > limit:
                    # A read that never returns (a hung store) must not hold its request forever: fail the load now;
                    # the scheduler keeps the CPU-tier slots the read may still write out of use until it returns.
                    self._abandoned.append((job, handles))
                    self._reads_abandoned.append(job.job_id)
                    self.stats.record_load_timeout()
                    logger.warning("offload_connector: load job %d for %s: read-back not done after %.1f s "
                                   "(load_timeout_s); reporting it failed", job.job_id, job.request_id, now - started)
                    self.engine.submit_failed_load(job, "read-back not done within load_timeout_s")
                else:
                    still.append((job, handles, started))
                continue
            bad = next((h for h in handles if not h.ok), None)
            if bad is None:
                self.engine.submit_load(job)
            else:
                self.engine.submit_failed_load(job, f"read-back into the CPU tier failed: {bad.error}")
        self._reading = still
        hung = []
        for job, handles in self._abandoned:
            if all(h.done() for h in handles):
                self._reads_settled.append(job.job_id)
            else:
                hung.append((job, handles))
        self._abandoned = hung

    def transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) since the last call."""
        self._collect()
        landed, self._landed = self._landed, []
        if self.faults is not None:
            landed = self.faults.report_loads(landed)  # debug.load_delay_steps holds them
        for rid, ok in landed:
            self._finished_recving.add(rid)
            if not ok:
                self._failed_recving.add(rid)
        sending = {rid for rid in self._delayed if rid not in self._stores_of}
        self._delayed -= sending
        recving, self._finished_recving = self._finished_recving, set()
        failed, self._failed_recving = self._failed_recving, set()
        return sending, recving, failed

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, _ = self.transfer_results()
        return sending or None, recving or None

    def worker_meta(self) -> OffloadWorkerMetadata | None:
        if not (self._stores_done or self._stores_failed or self._writes_done or self._writes_failed
                or self._reads_abandoned or self._reads_settled):
            return None
        meta = OffloadWorkerMetadata(stores_done=self._stores_done, stores_failed=self._stores_failed,
                                     writes_done=self._writes_done, writes_failed=self._writes_failed,
                                     reads_abandoned=self._reads_abandoned, reads_settled=self._reads_settled)
        self._stores_done, self._stores_failed, self._writes_done, self._writes_failed = [], [], {}, {}
        self._reads_abandoned, self._reads_settled = [], []
        return meta

    def take_stats(self) -> OffloadStats | None:
        return self.stats.take()

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.drain()
        for second in self.second_tiers.values():
            second.close()  # waits for the writes in flight (the disk tier fsyncs: a restart finds them)
        close = getattr(self.host_tier, "close", None)
        if close is not None:
            close()
