"""Bookkeeping of the copy jobs the scheduler side has issued and not yet seen finish.

A job holds tier entries (pinned by a load, reserved by a store) and, for a store, GPU blocks it still reads; the
book keeps, for each, what must be released when the worker reports it, so that no slot and no GPU block is reused
under a copy. It never decides anything: admission and store planning hand it jobs, the facade hands it reports.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Hashable, Iterable, Mapping

from offload_connector.metadata import TransferJob
from offload_connector.scheduler.events import TierEvents
from offload_connector.scheduler.state import ReqState
from offload_connector.scheduler.tier_index import TierIndex

if TYPE_CHECKING:
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.sched.output import SchedulerOutput


@dataclass
class LoadState:
    job: TransferJob
    keys: list[Hashable]  # every key the job copies, in job order
    tokens: int = 0  # the external tokens granted to vLLM for this load
    # Keys read back from a second tier (disk, shared) into freshly reserved CPU-tier entries (published when the
    # load lands), and what to tell each second tier when the load finishes: callback(read, ok, retired).
    promoted: list[Hashable] = field(default_factory=list)
    # Each read is its tier's own handle (disk_tier.ReadBack, remote_tier.Fetch): only its callback looks inside.
    read_back: list[tuple[Callable[..., None], object]] = field(default_factory=list)
    events: list[BlockStored] | None = None  # BlockStored events of the promoted entries, published when the load lands


@dataclass
class StoreState:
    request_id: str
    keys: list[Hashable]
    reports: int = 0  # workers that reported it done; it lands when every worker has


@dataclass(frozen=True)
class FinishedLoad:
    load: LoadState
    live: bool  # its request was still waiting for it (not aborted mid-copy)
    retired: bool  # issued before a reset: its entries were retired, nothing was unpinned or dropped


class JobBook:
    def __init__(self, tier: TierIndex, events: TierEvents, reporters: int) -> None:
        self.tier = tier
        # Called with the keys of every store that landed on every worker (second tiers write them through).
        self.on_stored: list[Callable[[list[Hashable], int], None]] = []
        self.events = events
        self.reporters = reporters  # workers that each report every store job (TP x PP)
        self.loads: dict[str, LoadState] = {}  # by request: admitted, copy in flight
        # Loads whose request was aborted mid-copy: their tier entries stay pinned until the worker reports them.
        self.orphan_loads: dict[int, LoadState] = {}
        self.store_jobs: dict[int, StoreState] = {}
        self.job_blocks: dict[int, tuple[int, ...]] = {}  # store job -> GPU blocks it reads
        self.block_readers: dict[int, set[int]] = {}  # GPU block -> store jobs still reading it
        # A store job's BlockStored events are built when it is planned, published when it lands.
        self.store_events: dict[int, list[BlockStored]] = {}
        # Jobs issued before the last reset_cache(): their tier entries are retired (see TierIndex.clear); when
        # they finish they release their slots instead of publishing or unpinning entries.
        self.retired_store_slots: dict[int, tuple[int, ...]] = {}
        self.retired_loads: set[int] = set()
        # Failed loads whose read-back a worker abandoned (load_timeout_s): outstanding reads per job, and the
        # CPU-tier slots those reads may still write, kept out of use until every one has returned.
        self.abandoned_reads: Counter[int] = Counter()
        self.held_read_slots: dict[int, tuple[int, ...]] = {}
        # Issued this step, handed to the workers by the next metadata.
        self.pending_loads: list[TransferJob] = []
        self.pending_stores: list[TransferJob] = []
        self.delayed_free: list[str] = []
        self.awaiting_free: set[str] = set()  # blocks kept alive for stores; vLLM frees on finished_sending
        self.next_job = 0

    # ------------------------------------------------------------------ issue
    def new_job_id(self) -> int:
        self.next_job += 1
        return self.next_job

    def add_load(self, job: TransferJob, keys: list[Hashable], tokens: int, promoted: list[Hashable] | None = None,
                 read_back: list[tuple[Callable[..., None], object]] | None = None,
                 events: list[BlockStored] | None = None) -> None:
        self.loads[job.request_id] = LoadState(job, keys, tokens, promoted or [], read_back or [], events)
        self.pending_loads.append(job)

    def add_store(self, job: TransferJob, keys: list[Hashable], events: list[BlockStored] | None) -> None:
        self.store_jobs[job.job_id] = StoreState(job.request_id, keys)
        if events is not None:
            self.store_events[job.job_id] = events
        self.job_blocks[job.job_id] = job.gpu_blocks
        for bid in job.gpu_blocks:
            self.block_readers.setdefault(bid, set()).add(job.job_id)
        self.pending_stores.append(job)

    def orphan(self, request_id: str) -> LoadState | None:
        """The request was aborted: its load in flight, if any, now belongs to nobody (see `orphan_loads`)."""
        load = self.loads.pop(request_id, None)
        if load is not None:
            self.orphan_loads[load.job.job_id] = load
        return load

    def delay_free(self, request_id: str) -> None:
        self.delayed_free.append(request_id)
        self.awaiting_free.add(request_id)

    def freed(self, request_id: str) -> None:
        self.awaiting_free.discard(request_id)

    def take_step(self) -> tuple[tuple[TransferJob, ...], tuple[TransferJob, ...], tuple[str, ...]]:
        """This step's loads, stores and delayed frees, for the metadata; the next step starts empty."""
        out = (tuple(self.pending_loads), tuple(self.pending_stores), tuple(self.delayed_free))
        self.pending_loads, self.pending_stores, self.delayed_free = [], [], []
        return out

    def fences(self, scheduler_output: SchedulerOutput) -> tuple[int, ...]:
        """Store jobs still reading a block that this step allocates afresh (freed by a window move, reused)."""
        if not self.block_readers:
            return ()
        fences: set[int] = set()

        def scan(block_ids: tuple[list[int], ...] | None) -> None:
            for ids in block_ids or ():
                for bid in ids:
                    readers = self.block_readers.get(bid)
                    if readers:
                        fences.update(readers)

        for new in scheduler_output.scheduled_new_reqs:
            scan(new.block_ids)
        for ids in scheduler_output.scheduled_cached_reqs.new_block_ids:
            scan(ids)
        return tuple(sorted(fences))

    # ----------------------------------------------------------------- finish
    def finish_load(self, request_id: str, ok: bool) -> FinishedLoad | None:
        """The worker reported `request_id`'s load: release its tier entries (drop them if it failed)."""
        load = self.loads.pop(request_id, None)
        live = load is not None
        if load is None:
            for job_id, orphan in list(self.orphan_loads.items()):
                if orphan.job.request_id == request_id:
                    load = self.orphan_loads.pop(job_id)
                    break
        if load is None:
            return None
        hold = not ok and self.abandoned_reads.get(load.job.job_id, 0) > 0
        if load.job.job_id in self.retired_loads:
            self.retired_loads.discard(load.job.job_id)
            if hold:
                self.held_read_slots[load.job.job_id] = tuple(load.job.host_slots)
            else:
                self.tier.release_retired(load.job.host_slots)
            for callback, read in load.read_back:
                callback(read, ok, True)
            return FinishedLoad(load, live, retired=True)
        if load.promoted:
            promoted = set(load.promoted)
            pinned = [k for k in load.keys if k not in promoted]
            # Read back from disk into entries reserved for them: readable CPU-tier entries now, or dropped.
            if hold:
                self.held_read_slots[load.job.job_id] = self.tier.retire(load.promoted)
            else:
                self.tier.finish_store(load.promoted, ok=ok)
            if ok:
                self.events.stored(load.events)
        else:
            pinned = load.keys
        self.tier.unpin(pinned)
        if not ok:
            self.tier.drop(pinned)
        for callback, read in load.read_back:
            callback(read, ok, False)
        return FinishedLoad(load, live, retired=False)

    def finish_store(self, job_id: int, ok: bool) -> str | None:
        """One worker reported store `job_id`. Returns its request once the job is over (every worker reported it
        done, or one reported it failed): its GPU blocks are free to reuse and its entries published or dropped."""
        store = self.store_jobs.get(job_id)
        if store is None:
            return None
        if ok and store.reports + 1 < self.reporters:
            store.reports += 1
            return None
        del self.store_jobs[job_id]
        for bid in self.job_blocks.pop(job_id, ()):
            readers = self.block_readers.get(bid)
            if readers is not None:
                readers.discard(job_id)
                if not readers:
                    del self.block_readers[bid]
        retired = self.retired_store_slots.pop(job_id, None)
        events = self.store_events.pop(job_id, None)
        if retired is not None:  # issued before a reset: its entries were retired, nothing is published
            self.tier.release_retired(retired)
        else:
            self.tier.finish_store(store.keys, ok=ok)
            if ok:
                self.events.stored(events)
                if self.on_stored:
                    # Spare entries take only spare room in the CPU tier; the second tiers get them if promoted.
                    regular = [k for k in store.keys if not self.tier.is_spare(k)]
                    for callback in self.on_stored:
                        callback(regular, job_id)
        return store.request_id

    def reads_abandoned(self, job_ids: Iterable[int]) -> None:
        """Workers reported these load jobs failed by load_timeout_s with reads still running (one report each)."""
        for job_id in job_ids:
            self.abandoned_reads[job_id] += 1

    def reads_settled(self, job_ids: Iterable[int]) -> None:
        """Abandoned reads returned (one report per worker): once all of a job's have, its held slots are free."""
        for job_id in job_ids:
            self.abandoned_reads[job_id] -= 1
            if self.abandoned_reads[job_id] > 0:
                continue
            del self.abandoned_reads[job_id]
            slots = self.held_read_slots.pop(job_id, None)
            if slots is not None:
                self.tier.release_retired(slots)

    def retire_in_flight(self) -> None:
        """Before `TierIndex.clear()`: remember the slots of every job in flight, which the reset retires."""
        for job_id, store in self.store_jobs.items():
            if job_id not in self.retired_store_slots:  # (retired by an earlier reset: its keys may be new entries)
                self.retired_store_slots[job_id] = tuple(self.tier.slot_of(k) for k in store.keys)
        self.store_events.clear()
        for load in (*self.loads.values(), *self.orphan_loads.values()):
            self.retired_loads.add(load.job.job_id)

    # ----------------------------------------------------------------- status
    def num_retired(self) -> int:
        return len(self.retired_store_slots) + len(self.retired_loads)

    def in_flight(self) -> bool:
        """A copy is issued and not reported: the engine is not idle even if no token is scheduled."""
        return bool(self.loads or self.orphan_loads or self.store_jobs or self.pending_loads)

    def busy(self) -> bool:
        """Something still needs an engine step: a copy to issue or collect, or blocks whose free is delayed."""
        return bool(self.loads or self.store_jobs or self.pending_loads or self.pending_stores
                    or self.awaiting_free or self.orphan_loads)

    def check(self, requests: Mapping[str, ReqState] | None = None) -> None:
        """Assert the book's internal invariants (and, given the per-request states, that their pending stores
        match the store jobs). For tests and simulations; walks everything."""
        loads = {**{ld.job.job_id: ld for ld in self.loads.values()}, **self.orphan_loads}
        assert len(loads) == len(self.loads) + len(self.orphan_loads), "a load is both live and orphaned"
        for rid, ld in self.loads.items():
            assert ld.job.request_id == rid, (rid, ld.job)
        for job_id, ld in self.orphan_loads.items():
            assert ld.job.job_id == job_id, (job_id, ld.job)
        for job_id, ld in loads.items():
            assert len(ld.keys) == ld.job.num_blocks, (job_id, len(ld.keys), ld.job.num_blocks)
        assert not set(loads) & set(self.store_jobs), "a job id is both a load and a store"
        assert all(0 < j <= self.next_job for j in (*loads, *self.store_jobs)), "a job id was never handed out"
        assert self.retired_loads <= set(loads), f"retired loads {self.retired_loads - set(loads)} not tracked"
        assert set(self.retired_store_slots) <= set(self.store_jobs), \
            f"retired store jobs {set(self.retired_store_slots) - set(self.store_jobs)} not tracked"
        assert set(self.store_events) <= set(self.store_jobs), "events kept for a store job not tracked"
        assert set(self.job_blocks) == set(self.store_jobs), \
            f"job blocks for {set(self.job_blocks) ^ set(self.store_jobs)} without a store job"
        for job_id, store in self.store_jobs.items():
            assert len(store.keys) == len(self.job_blocks[job_id]), (job_id, store.keys, self.job_blocks[job_id])
            assert 0 <= store.reports < self.reporters, (job_id, store.reports, self.reporters)
        readers: dict[int, set[int]] = {}
        for job_id, blocks in self.job_blocks.items():
            for bid in blocks:
                readers.setdefault(bid, set()).add(job_id)
        assert readers == self.block_readers, "block readers do not match the tracked store jobs' blocks"
        assert {j.job_id for j in self.pending_loads} <= set(loads), "a pending load is not tracked"
        assert {j.job_id for j in self.pending_stores} <= set(self.store_jobs), "a pending store is not tracked"
        assert set(self.delayed_free) <= self.awaiting_free, "a delayed free is not awaited"
        if requests is None:
            return
        for rid, state in requests.items():
            assert state.pending_stores <= set(self.store_jobs), (rid, state.pending_stores - set(self.store_jobs))
        for job_id, store in self.store_jobs.items():
            state = requests.get(store.request_id)
            assert state is None or job_id in state.pending_stores, (job_id, store.request_id)
