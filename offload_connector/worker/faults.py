"""Fault injection and debug delays: everything the config's `debug` section turns on, in one place.

Production code knows nothing of them. `install_faults` returns None when the section turns nothing on, and the
worker then builds a plain `TransferEngine` and reports its loads at once. Otherwise it returns a `WorkerFaults`,
which builds the worker's transfer engine with the faults wrapped around it:

* `fail_load` / `fail_load_ranks`: every load of this worker is reported failed without copying (the job carries the
  failure, as a load the scheduler could not serve does), after the engine waited for the stores still reading its
  destination blocks, as it does before any load;
* `fail_store_ranks`: every store of this worker is reported failed without copying, and without touching the host
  tier's checksums or the GPU blocks' readers;
* `corrupt_load`: a wrapper around the copier negates the first block of every load right after its copy, in the
  load's stream order, so `verify_loads` (whose checksums follow the copy on the same stream) sees it;
* `copy_delay_s`: the copy of every load (and whatever follows it in stream order) is issued that much later, so a
  CPU engine has a load that genuinely has not landed when `load_timeout_s` runs out;
* `load_delay_steps`: `report_loads` holds every landed load that many steps before vLLM hears of it, so a CPU engine
  has loads in flight across steps, as a GPU engine does. Only the report waits: the metrics count the load when it
  lands, as they do without the delay.

The second tiers (disk, shared) take no fault: a load with a read-back is failed, when it is, at its copy.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from offload_connector.config import DebugConfig
from offload_connector.log import get_logger
from offload_connector.transfer_jobs import TransferJob
from offload_connector.worker.transfers import Copier, CopyHandle, Issue, IssuedCopy, Kind, TransferEngine

if TYPE_CHECKING:
    from offload_connector.kernels.api import Direction

logger = get_logger(__name__)

INJECTED = "injected failure"


class WorkerFaults:
    """The debug section as it applies to one worker (its rank decides the `fail_*_ranks` ones).

    `fail_loads` and `fail_stores` may be switched off while the engine runs (the engine tests end a phase's faults
    this way); the engine reads them at every submit."""

    def __init__(self, debug: DebugConfig, rank: int) -> None:
        self.debug = debug
        self.rank = rank
        self.fail_loads = debug.fail_load or rank in debug.fail_load_ranks
        self.fail_stores = rank in debug.fail_store_ranks
        self.held: list[tuple[int, str, bool]] = []  # (steps left, request, ok): load_delay_steps

    def transfer_engine(self, copier: Copier, *args: Any, segments: Sequence[Sequence[int]],
                        views: Sequence[torch.Tensor], **kwargs: Any) -> TransferEngine:
        """The engine `TransferEngine(copier, *args, **kwargs)` would be, with this worker's faults around it.
        `segments` and `views` (the layout's pages per group and the KV cache views) locate the block to corrupt."""
        if self.debug.corrupt_load:
            copier = CorruptingCopier(copier, segments, views)
        return FaultyTransferEngine(self, copier, *args, **kwargs)

    def report_loads(self, landed: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
        """Once per step: the loads (request, ok) to report to vLLM now, of those that landed since the last step
        and those held from before; each is held `load_delay_steps` steps."""
        self.held.extend((self.debug.load_delay_steps, rid, ok) for rid, ok in landed)
        now: list[tuple[str, bool]] = []
        still: list[tuple[int, str, bool]] = []
        for left, rid, ok in self.held:
            if left > 0:
                still.append((left - 1, rid, ok))
            else:
                now.append((rid, ok))
        self.held = still
        return now


def install_faults(debug: DebugConfig, rank_of: Callable[[], int]) -> WorkerFaults | None:
    """This worker's faults, or None when the debug section turns nothing on (the worker runs as in production).

    `rank_of` is asked only when a `fail_*_ranks` key needs the rank (a simulated worker has no process groups).
    Each fault in force is announced once, here."""
    if not debug.enabled:
        return None
    faults = WorkerFaults(debug, rank_of() if (debug.fail_load_ranks or debug.fail_store_ranks) else 0)
    if debug.fail_load:
        logger.warning("offload_connector: debug.fail_load is on: every load is reported failed without copying "
                       "(fault injection for tests)")
    for what, on in (("load", faults.fail_loads and not debug.fail_load), ("store", faults.fail_stores)):
        if on:
            logger.warning("offload_connector: debug.fail_%s_ranks names this worker (rank %d): every %s is "
                           "reported failed without copying (fault injection for tests)", what, faults.rank, what)
    if debug.corrupt_load:
        logger.warning("offload_connector: debug.corrupt_load is on: every loaded prefix is deliberately "
                       "corrupted (fault injection for tests)")
    if debug.copy_delay_s:
        logger.warning("offload_connector: debug.copy_delay_s is on: the copy of every load is issued %g s late "
                       "(test aid)", debug.copy_delay_s)
    return faults


class FaultyTransferEngine(TransferEngine):
    """A `TransferEngine` that fails loads and stores, and issues loads late, as its `WorkerFaults` say."""

    def __init__(self, faults: WorkerFaults, copier: Copier, *args: Any, **kwargs: Any) -> None:
        super().__init__(copier, *args, **kwargs)
        self.faults = faults

    def submit_store(self, job: TransferJob) -> None:
        if self.faults.fail_stores:
            self.submit_failed_store(job, INJECTED)
            return
        super().submit_store(job)

    def submit_load(self, job: TransferJob) -> None:
        if self.faults.fail_loads and not job.fail_reason:
            # Carried by the job: the engine waits for the stores reading its blocks, then fails it, as it does a
            # load the scheduler refused (a reason the scheduler gave wins).
            job = replace(job, fail_reason=INJECTED)
        super().submit_load(job)

    def _issued_copy(self, kind: Kind, issue: Issue) -> IssuedCopy:
        if kind == "load" and self.faults.debug.copy_delay_s > 0:
            return LateCopy(issue, self.faults.debug.copy_delay_s)
        return super()._issued_copy(kind, issue)


class LateCopy(IssuedCopy):
    """A copy issued `delay_s` after it was submitted. Until then nothing has been copied and `query()` is false, so
    the deadline check sees a load that genuinely has not landed; the first `query` after the delay issues it, and
    `wait`/`order_before` sleep out the rest of the delay and issue it (a copy not issued yet cannot be ordered on a
    stream, so it is waited for on the host)."""

    def __init__(self, issue: Issue, delay_s: float) -> None:
        self._at = time.perf_counter() + delay_s
        self._later: Issue | None = None
        super().__init__(issue)

    def _issue(self, issue: Issue) -> None:
        self._later = issue  # the constructor's call: kept for `_start`

    def _start(self) -> None:
        issue, self._later = self._later, None
        if issue is not None:
            IssuedCopy._issue(self, issue)

    def query(self) -> bool:
        if self._later is not None:
            if time.perf_counter() < self._at:
                return False
            self._start()
        return super().query()

    def wait(self) -> None:
        if self._later is not None:
            time.sleep(max(0.0, self._at - time.perf_counter()))
            self._start()
        super().wait()

    @property
    def started(self) -> bool:
        return self._later is None and super().started

    def order_before(self, stream: torch.cuda.Stream | None) -> None:
        if self._later is not None:
            self.wait()
        super().order_before(stream)


class CorruptingCopier:
    """Wraps a copier: right after every host-to-GPU copy, on the copy's stream, the first block it loads (the first
    block of the first group it names) is negated."""

    def __init__(self, copier: Copier, segments: Sequence[Sequence[int]], views: Sequence[torch.Tensor]) -> None:
        self._copier = copier
        self._segments = segments
        self._views = views
        self.name = getattr(copier, "name", type(copier).__name__)

    def copy(self, direction: Direction, ids: Sequence[object], stream: torch.cuda.Stream | None = None
             ) -> CopyHandle:
        completion = self._copier.copy(direction, ids, stream=stream)
        if direction == "h2d":
            first = next(((g, pair) for g, pair in enumerate(ids) if pair is not None), None)
            if first is not None:
                group, (_slots, blocks) = first
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    self._corrupt(group, int(blocks[0]))
        return completion

    def _corrupt(self, group: int, block: int) -> None:
        # Flip the top bit of every other byte: for 16-bit KV (bf16/fp16, little-endian) that negates each value,
        # so the block stays finite and plausible instead of turning into NaNs a model might just propagate.
        for page in self._segments[group]:
            row = self._views[page][block]
            row[1::2] ^= 0x80
