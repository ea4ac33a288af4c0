"""Issues load and store jobs through a copier and tracks them until their bytes have landed.

Loads (host -> GPU) go on a high-priority stream so their copies are dispatched ahead of queued compute; stores
(GPU -> host) go on a low-priority stream that first waits for the compute stream, because a store reads blocks this
step's forward pass writes. On the CPU backend copies are synchronous and both "streams" are None.

A GPU block being read by an unfinished store must not be overwritten: a load into it waits for that store, and
the scheduler fences stores whose source blocks the next forward pass reuses (`wait_for_jobs`).

A load that has not landed by its deadline is reported failed, so vLLM recomputes (or fails) the request instead
of waiting forever. Its copy cannot be cancelled, though, and still writes into blocks vLLM will hand out again: until
it lands it stays a "zombie", and every later copy and forward pass is ordered after it (on the GPU by stream order;
a copy not issued yet, which only the debug section's `copy_delay_s` makes (worker/faults.py), is waited for on
the host).

With `ordered_loads` (load_completion "ordered"), a load is reported finished before its bytes land once its copy is
issued and should land before the forward that reads it (`landing.LandingEstimate`). Until they land it stays "ordered"
(`_ordered`): every later copy is ordered after it like a zombie's (a store may reuse the host slots it still reads),
and so is every forward pass from the step whose `load_fences` name it (the first whose forward may read its blocks) on.
Checksums can fail a load after its copy, so with them every load is reported once landed.

With `verify_loads` (a `SlotChecksums`), every store also queues the checksums of its source blocks right after its
copy, kept per host slot once the store lands, and every load queues the checksums of its destination blocks right
after its copy: a load whose blocks do not match their slots' checksums is reported failed like a late one.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Literal, Protocol, Sequence

import numpy as np
import torch

from offload_connector.log import get_logger
from offload_connector.transfer_jobs import TransferJob
from offload_connector.worker.checksum import PendingSums, SlotChecksums
from offload_connector.worker.landing import LandingEstimate

if TYPE_CHECKING:
    from offload_connector.kernels.api import Direction

logger = get_logger(__name__)

Kind = Literal["load", "store"]


class CopyHandle(Protocol):
    """Completion handle of one copy: `kernels.Completion`, or the handle of a copier the tests or the benchmarks'
    simulation pass in. Its `error`, `started` and `device_seconds` are optional (read with getattr)."""

    def query(self) -> bool: ...

    def wait(self) -> None: ...

    def order_before(self, stream: torch.cuda.Stream | None) -> None: ...


class Copier(Protocol):
    """What the engine issues copies through: a `kernels.BlockCopier`, or any object with its `copy`."""

    def copy(self, direction: Direction, ids: Sequence[object], stream: torch.cuda.Stream | None = None
             ) -> CopyHandle: ...


# Issues one job's copy and what follows it in stream order: the copy's handle, and its checksums if any.
Issue = Callable[[], tuple[CopyHandle, "PendingSums | None"]]


class IssuedCopy:
    """One job's copy and what follows it in stream order (checksums), with a completion handle's interface
    (`query`, `wait`, `order_before`). Issued when constructed (`_issue`); worker/faults.py issues some later."""

    def __init__(self, issue: Issue) -> None:
        self.completion: CopyHandle | None = None
        self.sums: PendingSums | None = None
        self.error: str | None = None
        # CUDA timing events recorded around the copy on its stream, once issued (loads under ordered_loads): its
        # own duration on the device.
        self.timing: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._issue(issue)

    def _issue(self, issue: Issue) -> None:
        try:
            self.completion, self.sums = issue()
        except Exception as exc:  # a copy that raised has landed, as a failure
            self.error = str(exc) or type(exc).__name__

    @property
    def failure(self) -> str | None:
        """Once landed: why the copy failed (it raised when issued, or its backend reported a failure when it
        landed, `Completion.error`), or None."""
        if self.error is not None:
            return self.error
        return getattr(self.completion, "error", None)

    def query(self) -> bool:
        if self.error is not None:
            return True
        return bool(self.completion.query()) and (self.sums is None or self.sums.query())

    def wait(self) -> None:
        if self.error is None:
            self.completion.wait()
            if self.sums is not None:
                self.sums.wait()

    @property
    def started(self) -> bool:
        """Issued, and its copy under way as far as the backend knows (the benchmarks' simulated backend can hold a
        copy back; a real backend's copy is under way once issued)."""
        return self.error is None and bool(getattr(self.completion, "started", True))

    def device_seconds(self) -> float | None:
        """Once landed: how long the copy itself took on the device, where that was measured."""
        if self.timing:
            start, end = self.timing[0]
            # Recorded after the copy's own completion event: it may not have been reached yet.
            return float(start.elapsed_time(end)) * 1e-3 if end.query() else None
        seconds = getattr(self.completion, "device_seconds", None)
        return seconds() if callable(seconds) else None

    def order_before(self, stream: torch.cuda.Stream | None) -> None:
        if self.error is None:
            self.completion.order_before(stream)
            if self.sums is not None:
                self.sums.order_before(stream)


@dataclass
class _InFlight:
    kind: Kind
    job: TransferJob
    completion: IssuedCopy | None  # None when the job failed before any copy
    started: float
    nbytes: int
    error: str | None = None


@dataclass(frozen=True)
class JobResult:
    kind: Kind
    job: TransferJob
    ok: bool
    seconds: float
    nbytes: int
    # A load whose blocks landed but did not match their stored checksums (verify_loads); `ok` is False then.
    verify_failed: bool = False
    # A load reported before its copy landed (ordered_loads).
    early: bool = False


class TransferEngine:
    def __init__(self, copier: Copier, num_groups: int, group_bytes: Sequence[int], device: torch.device,
                 load_timeout_s: float = 0.0, checksums: SlotChecksums | None = None, ordered_loads: bool = False,
                 clock: Callable[[], float] | None = None) -> None:
        self._copier = copier
        self._num_groups = num_groups
        self._group_bytes = list(group_bytes)
        self._device = device
        self._checksums = checksums
        self.verify_failures = 0
        self._jobs: dict[int, _InFlight] = {}
        self._zombies: dict[int, _InFlight] = {}  # timed-out loads whose copies have not landed yet
        # Loads reported finished before their bytes landed (ordered_loads) and not landed yet, and those of them a
        # step's load_fences named (every forward pass from then on is ordered after them).
        self._ordered_loads = ordered_loads and checksums is None
        self._ordered: dict[int, _InFlight] = {}
        self._fenced_loads: set[int] = set()
        # When the loads will land (only ordered_loads reads it): `clock` is the time it measures steps and the
        # link in (the benchmarks' simulation passes simulated time).
        self.landing = LandingEstimate(clock or time.perf_counter)
        self._load_timeout_s = load_timeout_s
        self.timeouts = 0
        self._readers: dict[int, set[int]] = {}  # GPU block -> unfinished store jobs reading it
        self.load_stream: torch.cuda.Stream | None = None
        self.store_stream: torch.cuda.Stream | None = None
        if device.type == "cuda":
            # Lower numbers are higher priority; range() gives (lowest, highest).
            low, high = torch.cuda.Stream.priority_range()
            self.load_stream = torch.cuda.Stream(device=device, priority=high)
            self.store_stream = torch.cuda.Stream(device=device, priority=low)

    # ------------------------------------------------------------------ submit
    def _ids(self, job: TransferJob) -> list[tuple[np.ndarray, np.ndarray] | None]:
        # Groups past the job's last entry move nothing (the scheduler side always names every group).
        if len(job.group_gpu_blocks) > self._num_groups:
            raise ValueError(f"job {job.job_id} names {len(job.group_gpu_blocks)} KV cache groups; this worker has "
                             f"{self._num_groups}")
        ids: list[tuple[np.ndarray, np.ndarray] | None] = [None] * self._num_groups
        for g, (blocks, slots) in enumerate(zip(job.group_gpu_blocks, job.group_host_slots)):
            if blocks:
                ids[g] = (np.asarray(slots, dtype=np.int64), np.asarray(blocks, dtype=np.int64))
        return ids

    def _nbytes(self, job: TransferJob) -> int:
        return sum(self._group_bytes[g] * len(blocks) for g, blocks in enumerate(job.group_gpu_blocks))

    @staticmethod
    def _on(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager[object]:
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def submit_store(self, job: TransferJob) -> None:
        started = time.perf_counter()
        self._after_unlanded(self.store_stream)
        if self._checksums is not None:
            self._checksums.invalidate(job.host_slots)  # the slots' old contents are being replaced

        def issue() -> tuple[CopyHandle, PendingSums | None]:
            if self.store_stream is not None:
                self.store_stream.wait_stream(torch.cuda.current_stream(self._device))
            completion = self._copier.copy("d2h", self._ids(job), stream=self.store_stream)
            sums = None
            if self._checksums is not None:
                # Same stream, after the copy: reads the source blocks as the copy read them (they cannot change
                # before the store lands: loads into them wait for it and the scheduler fences their reuse).
                with self._on(self.store_stream):
                    sums = self._checksums.measure(job.groups, job.gpu_blocks, self.store_stream)
            return completion, sums
        issued = self._issued_copy("store", issue)
        if issued.error is not None:  # a failed store only loses cache entries; report it, keep serving
            logger.warning("offload_connector: store job %d failed: %s", job.job_id, issued.error)
            self.submit_failed_store(job, issued.error, started)
            return
        self._jobs[job.job_id] = _InFlight("store", job, issued, started, self._nbytes(job))
        for bid in job.gpu_blocks:
            self._readers.setdefault(bid, set()).add(job.job_id)

    def submit_load(self, job: TransferJob) -> None:
        # Destination blocks still being read by an earlier store (freed by a window move, reallocated to this
        # request) must keep their old bytes until that store has them.
        self.wait_for_jobs({j for bid in job.gpu_blocks for j in self._readers.get(bid, ())})
        started = time.perf_counter()
        if job.fail_reason:
            self.submit_failed_load(job, job.fail_reason)
            return
        self._after_unlanded(self.load_stream)
        if self.load_stream is not None:
            # A destination block may have been freed by a request whose last forward pass is still queued on
            # the compute stream (async scheduling) and will write it: land after that, never under it.
            self.load_stream.wait_stream(torch.cuda.current_stream(self._device))

        timing: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

        def issue() -> tuple[CopyHandle, PendingSums | None]:
            start = None
            if self.load_stream is not None and self._ordered_loads:
                start = torch.cuda.Event(enable_timing=True)
                start.record(self.load_stream)
            completion = self._copier.copy("h2d", self._ids(job), stream=self.load_stream)
            if start is not None:
                end = torch.cuda.Event(enable_timing=True)
                end.record(self.load_stream)
                timing.append((start, end))
            sums = None
            if self._checksums is not None:
                with self._on(self.load_stream):
                    # On the device, after the copy: only the n checksums come back to the host.
                    sums = self._checksums.measure(job.groups, job.gpu_blocks, self.load_stream)
            return completion, sums
        issued = self._issued_copy("load", issue)
        issued.timing = timing
        if issued.error is not None:
            logger.warning("offload_connector: load job %d for %s failed: %s", job.job_id, job.request_id,
                           issued.error)
            self._jobs[job.job_id] = _InFlight("load", job, None, started, 0, issued.error)
            return
        self._jobs[job.job_id] = _InFlight("load", job, issued, started, self._nbytes(job))
        self.landing.submitted(job.job_id, self._nbytes(job))

    def _issued_copy(self, kind: Kind, issue: Issue) -> IssuedCopy:
        """A job's copy, issued now (worker/faults.py overrides this to issue loads late)."""
        return IssuedCopy(issue)

    def submit_failed_load(self, job: TransferJob, reason: str) -> None:
        """A load that failed before any copy (refused by the scheduler, its disk read-back failed, or injected by
        worker/faults.py): reported failed by the next poll, like a copy that failed."""
        logger.warning("offload_connector: load job %d for %s failed: %s", job.job_id, job.request_id, reason)
        self._jobs[job.job_id] = _InFlight("load", job, None, time.perf_counter(), 0, reason)

    def submit_failed_store(self, job: TransferJob, reason: str, started: float | None = None) -> None:
        """A store that failed before any copy (its copy raised, or injected by worker/faults.py): reported failed
        by the next poll. Only the caller logs it: an injected failure is announced once, not per store."""
        when = time.perf_counter() if started is None else started
        self._jobs[job.job_id] = _InFlight("store", job, None, when, 0, reason)

    # ---------------------------------------------------------------- complete
    def _after_zombies(self, stream: torch.cuda.Stream | None) -> None:
        for flight in self._zombies.values():
            flight.completion.order_before(stream)

    def _after_unlanded(self, stream: torch.cuda.Stream | None) -> None:
        """Before a copy: after every load still copying that vLLM was told is done or failed (zombies, ordered
        loads). The scheduler has released their host slots and GPU blocks, so this copy may reuse them."""
        self._after_zombies(stream)
        for flight in self._ordered.values():
            flight.completion.order_before(stream)

    def order_compute_after_loads(self, job_ids: Sequence[int]) -> None:
        """Before a forward pass: it may read (or, once vLLM reuses them, write) the blocks of these ordered loads,
        and every later forward may too. On CUDA the compute stream waits for their copies; elsewhere the host."""
        self.landing.fenced(job_ids)
        self._fenced_loads.update(job_ids)
        if not self._fenced_loads:
            return
        self._fenced_loads.intersection_update(self._ordered)
        stream = torch.cuda.current_stream(self._device) if self._device.type == "cuda" else None
        for job_id in self._fenced_loads:
            completion = self._ordered[job_id].completion
            if stream is None:
                completion.wait()
            else:
                completion.order_before(stream)

    def wait_for_ordered_loads(self) -> None:
        """Block the host until every ordered load has landed: before anything writes CPU-tier slots from the host
        (disk and shared-tier read-backs), which no stream orders after the copies still reading them."""
        for flight in self._ordered.values():
            flight.completion.wait()

    def order_compute_after_zombies(self) -> None:
        """Before a forward pass: it may write blocks a timed-out load is still copying into. On the CPU backend
        only a copy not issued yet (the debug section's copy_delay_s) can still be pending, and it is waited for
        here."""
        if self._zombies:
            self._after_zombies(torch.cuda.current_stream(self._device) if self._device.type == "cuda" else None)

    def wait_for_jobs(self, job_ids: set[int] | Sequence[int]) -> None:
        for job_id in job_ids:
            flight = self._jobs.get(job_id)
            if flight is not None and flight.completion is not None:
                flight.completion.wait()

    def poll(self) -> list[JobResult]:
        """Jobs whose copies have landed (or failed) since the last poll, in submission order."""
        done: list[JobResult] = []
        now = time.perf_counter()
        self.landing.poll()
        for pending in (self._zombies, self._ordered):
            for job_id, flight in list(pending.items()):
                if flight.completion.query():
                    del pending[job_id]
                    self.landing.landed(job_id, flight.completion.device_seconds())
        for job_id, flight in list(self._jobs.items()):
            if flight.completion is not None and not flight.completion.query():
                if (flight.kind == "load" and self._ordered_loads and flight.completion.started
                        and self.landing.lands_in_time(job_id)):
                    # Every later copy and the forward the scheduler fences are ordered after it, and it should
                    # land before that forward starts: report it now.
                    del self._jobs[job_id]
                    failure = flight.completion.failure
                    if failure is None:
                        self._ordered[job_id] = flight
                    else:
                        self.landing.dropped(job_id)
                        logger.warning("offload_connector: load job %d for %s failed: %s", job_id,
                                       flight.job.request_id, failure)
                    done.append(JobResult("load", flight.job, failure is None, now - flight.started, flight.nbytes,
                                          early=failure is None))
                    continue
                if (flight.kind == "load" and self._load_timeout_s > 0
                        and now - flight.started > self._load_timeout_s):
                    del self._jobs[job_id]
                    self._zombies[job_id] = flight
                    self.timeouts += 1
                    logger.warning("offload_connector: load job %d for %s not done after %.1f s; reporting it failed",
                                   job_id, flight.job.request_id, now - flight.started)
                    done.append(JobResult("load", flight.job, False, now - flight.started, 0))
                continue
            del self._jobs[job_id]
            issued = flight.completion
            failure = issued.failure if issued is not None else flight.error
            if flight.kind == "load":
                self.landing.landed(job_id, issued.device_seconds() if issued is not None else None)
            ok = issued is not None and failure is None
            if issued is not None and failure is not None:  # a delayed copy that raised, or a copy that landed failed
                logger.warning("offload_connector: %s job %d for %s failed: %s", flight.kind, job_id,
                               flight.job.request_id, failure)
            verify_failed = False
            if flight.kind == "store":
                for bid in flight.job.gpu_blocks:
                    readers = self._readers.get(bid)
                    if readers is not None:
                        readers.discard(job_id)
                        if not readers:
                            del self._readers[bid]
                if ok and issued.sums is not None:
                    self._checksums.record(flight.job.host_slots, issued.sums.values())
            elif ok and issued.sums is not None:
                bad = self._checksums.mismatches(flight.job.host_slots, issued.sums.values())
                if bad.size:
                    ok, verify_failed = False, True
                    self.verify_failures += 1
                    job, first = flight.job, int(bad[0])
                    logger.warning("offload_connector: load job %d for %s: %d of %d blocks do not match the "
                                   "checksums stored with them (first: group %d, GPU block %d, host slot %d); "
                                   "reporting the load failed", job_id, job.request_id, bad.size, job.num_blocks,
                                   job.groups[first], job.gpu_blocks[first], job.host_slots[first])
            done.append(JobResult(flight.kind, flight.job, ok, time.perf_counter() - flight.started,
                                  flight.nbytes, verify_failed))
        if self._ordered_loads:
            for result in done:
                if result.kind == "load":
                    self.landing.reported(result.job.job_id)
        return done

    def pending(self) -> int:
        return len(self._jobs) + len(self._zombies) + len(self._ordered)

    def drain(self) -> list[JobResult]:
        self.wait_for_jobs(list(self._jobs))
        for flight in (*self._zombies.values(), *self._ordered.values()):
            flight.completion.wait()
        return self.poll()
