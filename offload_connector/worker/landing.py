"""When the loads on the host-to-GPU stream will land: the estimate behind reporting a load before it has landed.

With load_completion "ordered" a load may be reported to vLLM before its bytes are on the GPU, because the forward
pass that reads it is ordered after the copy. Reported too early, that forward (and every request in its batch)
waits for the copy; so a load is reported early only when it should land by the time that forward starts: about one
step after the poll that reports it (the scheduler learns of it after scheduling the next batch, and the batch
after that is the first to run the request).

The estimate uses what the worker can measure itself: the time between its polls (the median of the last few, so
that an idle engine's quick empty steps or a jump over an idle stretch do not count as a step) and the link's rate
over the loads that landed before, from each copy's own duration on the device (CUDA timing events around it) or,
where that is unknown, as if it had landed at the poll that saw it (later than it did: the rate errs low, and a load
is reported late rather than early). Until one load has landed nothing is reported early.
"""

from __future__ import annotations

from collections import deque
from statistics import median
from typing import Callable

_SMOOTHING = 0.5  # weight of the newest sample in the running link rate
_STEPS = 8  # poll intervals the step time is the median of


class LandingEstimate:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.bytes_per_s: float | None = None  # the host-to-GPU link's rate, from landed loads
        self._intervals: deque[float] = deque(maxlen=_STEPS)  # between the last polls
        self._poll_at: float | None = None
        self._queue: dict[int, tuple[float, int]] = {}  # unlanded loads in submission order: (submitted at, bytes)
        self._free_at = 0.0  # when the last load seen landing had landed, at the latest

    def submitted(self, job_id: int, nbytes: int) -> None:
        self._queue[job_id] = (self._clock(), nbytes)

    def poll(self) -> None:
        """The worker polls its copies (once a step): the step time, and the time the landings it sees count at."""
        now = self._clock()
        if self._poll_at is not None and now > self._poll_at:
            self._intervals.append(now - self._poll_at)
        self._poll_at = now

    @property
    def step_s(self) -> float | None:
        """The time of one step: the median of the last poll intervals."""
        return median(self._intervals) if self._intervals else None

    def landed(self, job_id: int, seconds: float | None = None) -> None:
        """The load's copy was seen landed at this poll; `seconds`: its own duration on the device, if measured."""
        entry = self._queue.pop(job_id, None)
        if entry is None or self._poll_at is None:
            return
        submitted, nbytes = entry
        start = max(submitted, self._free_at)
        if seconds is None or seconds <= 0:
            seconds = self._poll_at - start  # at most: it landed by this poll
            end = self._poll_at
        else:
            end = min(self._poll_at, start + seconds)
        if nbytes > 0 and seconds > 0:
            self.bytes_per_s = _smooth(self.bytes_per_s, nbytes / seconds)
        self._free_at = max(self._free_at, end)

    def dropped(self, job_id: int) -> None:
        """A load that copied nothing (failed when issued)."""
        self._queue.pop(job_id, None)

    def lands_within_a_step(self, job_id: int) -> bool:
        """Whether the load should have landed one step from this poll, behind the loads queued before it."""
        step_s = self.step_s
        if self.bytes_per_s is None or step_s is None or self._poll_at is None or job_id not in self._queue:
            return False
        eta = self._free_at
        for queued, (submitted, nbytes) in self._queue.items():
            eta = max(eta, submitted) + nbytes / self.bytes_per_s
            if queued == job_id:
                break
        return eta <= self._poll_at + step_s


def _smooth(old: float | None, sample: float) -> float:
    return sample if old is None else (1 - _SMOOTHING) * old + _SMOOTHING * sample
