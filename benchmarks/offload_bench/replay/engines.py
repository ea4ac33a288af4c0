"""Transfers that take simulated time (bytes / bandwidth) instead of a fixed number of steps.

For both workers the replay compares: `ClockTiming` times the simulated copy backend under our connector's real
worker (`sim.tagcopy.TagCopier`, which also lets the driver check that every loaded block holds the tokens that were
stored), and `TimedFakeOffloadingWorker` is the copy engine under vLLM's real `OffloadingConnectorWorker`. Only the
due time of a job changes: it is the finish time on its direction's stream (see timemodel.SimClock), compared against
the end time of the batch whose output reports it.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from offload_bench.replay.timemodel import SimClock
from offload_bench.sim.vllm_offloading import FakeOffloadingWorker, _Job, spec_bytes  # noqa: F401 (re-exported)


def block_id_bytes(worker_kv_cache_config: Any) -> list[int]:
    """Bytes one GPU block id of each KV cache group spans, from the worker's (planned) config.

    A packed group (`UniformTypeKVCacheSpecs`, DeepSeek V4) already reports the whole block id as its page; a
    plain group's page is per layer. (Multiplying a packed page by the layer count would overstate DeepSeek V4's
    transfers 20-62x.)
    """
    out = []
    for g in worker_kv_cache_config.kv_cache_groups:
        spec = g.kv_cache_spec
        packed = type(spec).__name__ == "UniformTypeKVCacheSpecs"
        out.append(spec.page_size_bytes if packed else spec.page_size_bytes * len(g.layer_names))
    return out


class TransferTally:
    def __init__(self) -> None:
        self.load_bytes = 0
        self.store_bytes = 0
        self.load_jobs = 0
        self.store_jobs = 0

    def add(self, is_load: bool, nbytes: int) -> None:
        if is_load:
            self.load_bytes += nbytes
            self.load_jobs += 1
        else:
            self.store_bytes += nbytes
            self.store_jobs += 1


class ClockTiming:
    """`TagCopier` timing: a copy lands when its bytes have crossed the simulated link, and the worker reports it
    when the batch whose output is applied next has ended."""

    def __init__(self, clock: SimClock, group_block_bytes: Sequence[int]) -> None:
        self.clock = clock
        self.group_bytes = list(group_block_bytes)
        self.tally = TransferTally()

    def due(self, job: Any, is_load: bool, step: int, not_before: float = 0.0) -> float:
        nbytes = sum(self.group_bytes[g] for g in job.groups)
        self.tally.add(is_load, nbytes)
        return self.clock.schedule_transfer("load" if is_load else "store", nbytes, not_before)

    def now(self, step: int) -> float:
        # Copies land just before the batch's output is applied: those that finished by the end of that batch.
        return self.clock.peek_applied_batch_end()

    def seconds(self, job: Any, is_load: bool) -> float:
        # The copy's own time on the link: its bytes over the bandwidth.
        return self.clock.model.transfer_seconds(sum(self.group_bytes[g] for g in job.groups))

    def time_at(self, step: int) -> float:
        # The start of the batch scheduled last: where a copy issued now starts, and, when an earlier batch's output
        # is applied (the worker polls), that batch's end.
        return self.clock.batch_start

    def forward_waits_until(self, due: float) -> None:
        # The forward of the batch being issued is ordered after a load that lands at `due` (load_completion
        # "ordered"): on the GPU it starts then, and so does everything queued behind it.
        self.clock.delay_batch_until(due)


class TimedFakeOffloadingWorker(FakeOffloadingWorker):
    """The copy engine under vLLM's real OffloadingConnectorWorker, with bandwidth-based completion."""

    def __init__(self, clock: SimClock, bytes_per_block: Callable[[Any], int]) -> None:
        super().__init__(latency_steps=0, bytes_per_block=bytes_per_block)
        self.clock = clock
        self.tally = TransferTally()

    def _submit(self, kind: str, job_id: int, gpu_spec: Any) -> bool:
        nbytes, nblocks = self._measure(gpu_spec)
        is_load = kind != "store"
        due = self.clock.schedule_transfer("load" if is_load else "store", nbytes)
        self._queues[kind].append(_Job(job_id, due, nbytes))  # type: ignore[arg-type]
        self.submitted[kind] += 1
        self.blocks[kind] += nblocks
        self.tally.add(is_load, nbytes)
        return True

    def get_finished(self) -> list[Any]:
        # vLLM's worker polls at the end of the forward of the batch it is executing.
        self.now = self.clock.batch_end  # type: ignore[assignment]
        return super().get_finished()
