"""Issues load and store jobs through a copier and tracks them until their bytes have landed.

Loads (host -> GPU) go on a high-priority stream so their copies are dispatched ahead of queued compute; stores
(GPU -> host) go on a low-priority stream that first waits for the compute stream, because a store reads blocks this
step's forward pass writes. On the CPU backend copies are synchronous and both "streams" are None.

A GPU block being read by an unfinished store must not be overwritten: a load into it waits for that store, and
the scheduler fences stores whose source blocks the next forward pass reuses (`wait_for_jobs`).

A load that has not landed by its deadline is reported failed, so vLLM recomputes (or fails) the request instead
of waiting forever. Its copy cannot be cancelled, though, and still writes into blocks vLLM will hand out again: until
it lands it stays a "zombie", and every later copy and forward pass is ordered after it on the GPU.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

import numpy as np
import torch

from offload_connector.metadata import TransferJob

logger = logging.getLogger("offload_connector")

Kind = Literal["load", "store"]


@dataclass
class _InFlight:
    kind: Kind
    job: TransferJob
    completion: Any  # kernels.Completion, or None when the copy raised
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


class TransferEngine:
    def __init__(self, copier: Any, num_groups: int, group_bytes: Sequence[int], device: torch.device,
                 on_load_landed: Callable[[TransferJob], None] | None = None, load_timeout_s: float = 0.0,
                 fail_loads: bool = False) -> None:
        self._copier = copier
        self._num_groups = num_groups
        self._group_bytes = list(group_bytes)
        self._device = device
        self._on_load_landed = on_load_landed
        self._jobs: dict[int, _InFlight] = {}
        self._zombies: dict[int, _InFlight] = {}  # timed-out loads whose copies have not landed yet
        self._load_timeout_s = load_timeout_s
        self._fail_loads = fail_loads
        self.timeouts = 0
        self._readers: dict[int, set[int]] = {}  # GPU block -> unfinished store jobs reading it
        self.load_stream: Any = None
        self.store_stream: Any = None
        if device.type == "cuda":
            # Lower numbers are higher priority; range() gives (lowest, highest).
            low, high = torch.cuda.Stream.priority_range()
            self.load_stream = torch.cuda.Stream(device=device, priority=high)
            self.store_stream = torch.cuda.Stream(device=device, priority=low)

    # ------------------------------------------------------------------ submit
    def _ids(self, job: TransferJob) -> list[tuple[np.ndarray, np.ndarray] | None]:
        groups = np.asarray(job.groups, dtype=np.int64)
        host = np.asarray(job.host_slots, dtype=np.int64)
        gpu = np.asarray(job.gpu_blocks, dtype=np.int64)
        out: list[tuple[np.ndarray, np.ndarray] | None] = []
        for g in range(self._num_groups):
            sel = groups == g
            out.append((host[sel], gpu[sel]) if sel.any() else None)
        return out

    def _nbytes(self, job: TransferJob) -> int:
        return sum(self._group_bytes[g] for g in job.groups)

    def submit_store(self, job: TransferJob) -> None:
        started = time.perf_counter()
        self._after_zombies(self.store_stream)
        try:
            if self.store_stream is not None:
                self.store_stream.wait_stream(torch.cuda.current_stream(self._device))
            completion = self._copier.copy("d2h", self._ids(job), stream=self.store_stream)
        except Exception as exc:  # a failed store only loses cache entries; report it, keep serving
            logger.warning("offload_connector: store job %d failed: %s", job.job_id, exc)
            self._jobs[job.job_id] = _InFlight("store", job, None, started, 0, str(exc))
            return
        self._jobs[job.job_id] = _InFlight("store", job, completion, started, self._nbytes(job))
        for bid in job.gpu_blocks:
            self._readers.setdefault(bid, set()).add(job.job_id)

    def submit_load(self, job: TransferJob) -> None:
        # Destination blocks still being read by an earlier store (freed by a window move, reallocated to this
        # request) must keep their old bytes until that store has them.
        self.wait_for_jobs({j for bid in job.gpu_blocks for j in self._readers.get(bid, ())})
        started = time.perf_counter()
        if self._fail_loads:
            self._jobs[job.job_id] = _InFlight("load", job, None, started, 0, "injected failure (debug_fail_load)")
            return
        self._after_zombies(self.load_stream)
        try:
            if self.load_stream is not None:
                # A destination block may have been freed by a request whose last forward pass is still queued on
                # the compute stream (async scheduling) and will write it: land after that, never under it.
                self.load_stream.wait_stream(torch.cuda.current_stream(self._device))
            completion = self._copier.copy("h2d", self._ids(job), stream=self.load_stream)
        except Exception as exc:
            logger.warning("offload_connector: load job %d for %s failed: %s", job.job_id, job.request_id, exc)
            self._jobs[job.job_id] = _InFlight("load", job, None, started, 0, str(exc))
            return
        self._jobs[job.job_id] = _InFlight("load", job, completion, started, self._nbytes(job))

    # ---------------------------------------------------------------- complete
    def _after_zombies(self, stream: Any) -> None:
        for flight in self._zombies.values():
            flight.completion.order_before(stream)

    def order_compute_after_zombies(self) -> None:
        """Before a forward pass: it may write blocks a timed-out load is still copying into."""
        if self._zombies and self._device.type == "cuda":
            self._after_zombies(torch.cuda.current_stream(self._device))

    def wait_for_jobs(self, job_ids: set[int] | Sequence[int]) -> None:
        for job_id in job_ids:
            flight = self._jobs.get(job_id)
            if flight is not None and flight.completion is not None:
                flight.completion.wait()

    def poll(self) -> list[JobResult]:
        """Jobs whose copies have landed (or failed) since the last poll, in submission order."""
        done: list[JobResult] = []
        now = time.perf_counter()
        for job_id, flight in list(self._zombies.items()):
            if flight.completion.query():
                del self._zombies[job_id]
        for job_id, flight in list(self._jobs.items()):
            if flight.completion is not None and not flight.completion.query():
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
            ok = flight.completion is not None
            if flight.kind == "store":
                for bid in flight.job.gpu_blocks:
                    readers = self._readers.get(bid)
                    if readers is not None:
                        readers.discard(job_id)
                        if not readers:
                            del self._readers[bid]
            elif ok and self._on_load_landed is not None:
                self._on_load_landed(flight.job)
            done.append(JobResult(flight.kind, flight.job, ok, time.perf_counter() - flight.started,
                                  flight.nbytes))
        return done

    def pending(self) -> int:
        return len(self._jobs) + len(self._zombies)

    def drain(self) -> list[JobResult]:
        self.wait_for_jobs(list(self._jobs))
        for flight in self._zombies.values():
            flight.completion.wait()
        return self.poll()
