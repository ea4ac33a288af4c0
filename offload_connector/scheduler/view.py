"""A read-only copy of the scheduler side's bookkeeping, for invariant checks in tests and simulations.

`OffloadScheduler.view()` builds one on demand; nothing on the scheduler's own path reads it. Every container is a
copy (tuples, frozensets, read-only mappings), so a check can hold one across steps and compare."""

from __future__ import annotations

from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Hashable, Mapping

from offload_connector.metadata import TransferJob
from offload_connector.scheduler.jobs import JobBook, LoadState
from offload_connector.scheduler.state import ReqState


@dataclass(frozen=True)
class RequestView:
    request_id: str
    finished: bool  # vLLM finished it; kept while its stores are in flight
    deferred_since: int | None
    no_load: bool
    pending_stores: frozenset[int]
    offered_hit: int
    full_stored: tuple[int, ...]
    window_next: tuple[int, ...]
    window_scanned: int


@dataclass(frozen=True)
class LoadView:
    job: TransferJob
    keys: tuple[Hashable, ...]  # tier keys in prefix order (not the group-by-group order of job.gpu_blocks)
    tokens: int


@dataclass(frozen=True)
class StoreJobView:
    request_id: str
    keys: tuple[Hashable, ...]  # tier keys in prefix order (not the group-by-group order of job.gpu_blocks)
    reports: int  # workers that have reported it done so far


@dataclass(frozen=True)
class SchedulerView:
    step: int
    requests: Mapping[str, RequestView]
    loads: Mapping[str, LoadView]  # by request: admitted, copy in flight
    orphan_loads: Mapping[int, LoadView]  # by job: request aborted mid-copy, entries pinned until reported
    store_jobs: Mapping[int, StoreJobView]
    job_blocks: Mapping[int, tuple[int, ...]]  # store job -> GPU blocks it reads
    block_readers: Mapping[int, frozenset[int]]  # GPU block -> store jobs reading it
    retired_store_slots: Mapping[int, tuple[int, ...]]  # store jobs issued before a reset -> their retired slots
    retired_loads: frozenset[int]  # load jobs issued before a reset
    pending_loads: tuple[TransferJob, ...]  # issued, not yet in a step's metadata
    pending_stores: tuple[TransferJob, ...]
    delayed_free: tuple[str, ...]
    awaiting_free: frozenset[str]  # requests whose blocks vLLM frees on finished_sending
    store_event_jobs: frozenset[int]  # store jobs whose BlockStored events wait for them to land

    def load_jobs(self) -> tuple[LoadView, ...]:
        """Every load in flight, live or orphaned."""
        return (*self.loads.values(), *self.orphan_loads.values())

    def leftovers(self) -> dict[str, list]:
        """What is still tracked, by name; empty once everything is drained."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "step" and value:
                out[f.name] = list(value)[:5]
        return out


def build_view(step: int, requests: Mapping[str, ReqState], jobs: JobBook) -> SchedulerView:
    return SchedulerView(
        step=step,
        requests=_frozen({rid: _request_view(rid, s) for rid, s in requests.items()}),
        loads=_frozen({rid: _load_view(ld) for rid, ld in jobs.loads.items()}),
        orphan_loads=_frozen({j: _load_view(ld) for j, ld in jobs.orphan_loads.items()}),
        store_jobs=_frozen({j: StoreJobView(s.request_id, tuple(s.keys), s.reports)
                            for j, s in jobs.store_jobs.items()}),
        job_blocks=_frozen(dict(jobs.job_blocks)),
        block_readers=_frozen({b: frozenset(r) for b, r in jobs.block_readers.items()}),
        retired_store_slots=_frozen(dict(jobs.retired_store_slots)),
        retired_loads=frozenset(jobs.retired_loads),
        pending_loads=tuple(jobs.pending_loads),
        pending_stores=tuple(jobs.pending_stores),
        delayed_free=tuple(jobs.delayed_free),
        awaiting_free=frozenset(jobs.awaiting_free),
        store_event_jobs=frozenset(jobs.store_events),
    )


def _request_view(rid: str, s: ReqState) -> RequestView:
    return RequestView(rid, s.finished, s.deferred_since, s.no_load, frozenset(s.pending_stores), s.offered_hit,
                       tuple(s.full_stored), tuple(s.window_next), s.window_scanned)


def _load_view(load: LoadState) -> LoadView:
    return LoadView(load.job, tuple(load.keys), load.tokens)


def _frozen(d: dict) -> Mapping:
    return MappingProxyType(d)
