"""When the loads on the host-to-GPU stream will land: the estimate behind reporting a load before it has landed.

With load_completion "ordered" a load may be reported to vLLM before its bytes are on the GPU, because the forward
pass that reads it is ordered after the copy. Reported too early, that forward (and every request in its batch)
waits for the copy; so a load is reported early only when it should land by the time that forward starts.

The estimate uses what the worker can measure itself: how long after a poll that forward starts, and the link's
rate over the loads that landed before, from each copy's own duration on the device (CUDA timing events around it)
or, where that is unknown, as if it had landed at the poll that saw it (later than it did: the rate errs low, and a
load is reported late rather than early). Until one load has landed nothing is reported early.

The horizon is measured on the loads reported before: the scheduler names each reported load in the metadata of the
first step it schedules after learning of it (`load_fences`), so the time from the poll that reported a load to the
forward that first fences it is exactly the time its report bought; the horizon is the shortest of the last few (a
forward that waits for a copy holds back every request in its batch, a report that comes late only the loaded
request, so the horizon errs short). What it comes to depends on the engine: about one step under async scheduling
(the scheduler reads a step's report only after scheduling the next batch), the next forward without it, and under
pipeline parallelism with several batches in flight a fraction of the time between polls, which there come in
bursts (a step that schedules nothing waits for the queued batches, and the worker polls once per batch at one
instant, then not again for a whole round). Until a reported load has been fenced, the time between polls (the
median of the last few, so that an idle engine's quick empty steps or a jump over an idle stretch do not count as a
step) stands in for it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from statistics import median
from typing import Callable, Iterable

_SMOOTHING = 0.5  # weight of the newest sample in the running link rate
_STEPS = 8  # poll intervals the step time is the median of; report-to-fence gaps the horizon is the least of
_UNFENCED = 1024  # reported loads kept waiting for their fence (a load of an aborted request may never get one)


class LandingEstimate:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.bytes_per_s: float | None = None  # the host-to-GPU link's rate, from landed loads
        self._intervals: deque[float] = deque(maxlen=_STEPS)  # between the last polls
        self._poll_at: float | None = None
        self._reported: OrderedDict[int, float] = OrderedDict()  # reported loads not fenced yet: their poll's time
        self._gaps: deque[float] = deque(maxlen=_STEPS)  # from a report's poll to the forward that first fenced it
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

    @property
    def horizon_s(self) -> float | None:
        """How long after a poll the forward that reads a load reported there starts, at the soonest: the shortest
        of the last report-to-fence gaps, or the step time until one has been seen."""
        return min(self._gaps) if self._gaps else self.step_s

    def reported(self, job_id: int) -> None:
        """The load was reported to vLLM at this poll (landed or not, failed or not: the scheduler fences each)."""
        if self._poll_at is None:
            return
        self._reported[job_id] = self._poll_at
        if len(self._reported) > _UNFENCED:
            self._reported.popitem(last=False)

    def fenced(self, job_ids: Iterable[int]) -> None:
        """A forward pass starts that the scheduler ordered after these loads: the first to read them."""
        now = None
        for job_id in job_ids:
            at = self._reported.pop(job_id, None)
            if at is not None:
                now = self._clock() if now is None else now
                self._gaps.append(max(0.0, now - at))

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

    def lands_in_time(self, job_id: int) -> bool:
        """Whether the load should have landed by the time the forward that reads it starts (`horizon_s` from this
        poll), behind the loads queued before it."""
        horizon_s = self.horizon_s
        if self.bytes_per_s is None or horizon_s is None or self._poll_at is None or job_id not in self._queue:
            return False
        eta = self._free_at
        for queued, (submitted, nbytes) in self._queue.items():
            eta = max(eta, submitted) + nbytes / self.bytes_per_s
            if queued == job_id:
                break
        return eta <= self._poll_at + horizon_s


def _smooth(old: float | None, sample: float) -> float:
    return sample if old is None else (1 - _SMOOTHING) * old + _SMOOTHING * sample
