"""Drive vLLM's in-tree `OffloadingConnector` in the real scheduler on CPU, with only its copy engine simulated.

The scheduler role is the real one (built by `Scheduler.__init__`). The worker role is the real
`OffloadingConnector(role=WORKER)` with its real `OffloadingConnectorWorker`; only the object that would issue the
CUDA copies (`OffloadingConnectorWorker.worker`, an `OffloadingWorker` from `vllm/v1/kv_offload/base.py`) is replaced
by `FakeOffloadingWorker`, which keeps a FIFO per direction and reports each job finished `latency_steps` engine steps
after it was submitted. `register_kv_caches` is never called (it needs the real KV tensors to derive the canonical
layout); it would only have built that same `OffloadingWorker` (and, on 0.34, the canonical caches its pointer
resolution reads: `_pointer_stand_in`).

Each step replays the model runner's call order (gpu_model_runner.py / kv_connector_model_runner_mixin.py): the
metadata is pickled as between processes, then `handle_preemptions`, `bind_connector_metadata`, `start_load_kv`,
the (simulated) forward, `wait_for_save`, `get_transfer_results`, `build_connector_worker_meta`,
`clear_connector_metadata`; outputs go through `KVOutputAggregator` as in the executor, then to
`Scheduler.update_from_output`. No tags are copied: this is for driving and timing, not for checking contents.
"""

from __future__ import annotations

import pickle
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult

from offload_bench.sim.drafts import DraftCounts, DraftSampler
from offload_bench.sim.vllm_compat import runner_output

__all__ = ["FakeOffloadingWorker", "VllmOffloadingWorkerSim", "VllmOffloadingDriver", "offloading_config"]


def offloading_config(cpu_bytes_to_use: int, **extra: Any) -> Any:
    """KVTransferConfig selecting vLLM's in-tree OffloadingConnector (default CPUOffloadingSpec)."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                            kv_connector_extra_config={"cpu_bytes_to_use": cpu_bytes_to_use, **extra})


@dataclass
class _Job:
    job_id: int
    due: int
    nbytes: int


class FakeOffloadingWorker(OffloadingWorker):
    """Stands in for `CPUOffloadingWorker`: no copies, each job completes `latency_steps` steps after submission.

    Jobs complete in submission order per direction (store, load, expedited load), like the real per-direction
    CUDA streams. `wait(job_ids)` completes those jobs at once (the real one blocks on their events).
    """

    def __init__(self, latency_steps: int = 1, bytes_per_block: Callable[[Any], int] | None = None) -> None:
        self.latency = latency_steps
        self.now = 0  # set by the driver each step
        self._bytes = bytes_per_block or (lambda spec: 0)
        self._queues: dict[str, deque[_Job]] = {"store": deque(), "load": deque(), "expedited": deque()}
        self._done_early: list[_Job] = []
        self.submitted = {"store": 0, "load": 0, "expedited": 0}
        self.blocks = {"store": 0, "load": 0, "expedited": 0}

    def _measure(self, gpu: Any) -> tuple[int, int]:
        """Bytes and GPU blocks of a job's GPU side: a `GPULoadStoreSpec` (block ids per group) up to vLLM 0.33,
        resolved `DevicePointers` (one copy op per block and data reference, with its byte size) from 0.34."""
        if hasattr(gpu, "group_block_counts"):
            return int(gpu.sizes.sum()), int(sum(gpu.group_block_counts))
        return self._bytes(gpu), len(gpu.block_ids)

    def _submit(self, kind: str, job_id: int, gpu: Any) -> bool:
        nbytes, nblocks = self._measure(gpu)
        self._queues[kind].append(_Job(job_id, self.now + self.latency, nbytes))
        self.submitted[kind] += 1
        self.blocks[kind] += nblocks
        return True

    # The GPU side is the second argument of a store and the third of a load in every release.
    def submit_store(self, job_id: int, src: Any, dst_spec: Any) -> bool:
        return self._submit("store", job_id, src)

    def submit_load(self, job_id: int, src_spec: Any, dst: Any, expedited: bool = False) -> bool:
        return self._submit("expedited" if expedited else "load", job_id, dst)

    def get_finished(self) -> list[TransferResult]:
        out = [self._result(j) for j in self._done_early]
        self._done_early = []
        for q in self._queues.values():
            while q and q[0].due <= self.now:
                out.append(self._result(q.popleft()))
        return out

    def wait(self, job_ids: set[int]) -> None:
        for q in self._queues.values():
            keep = deque()
            for j in q:
                (self._done_early if j.job_id in job_ids else keep).append(j)
            q.clear()
            q.extend(keep)

    def pending(self) -> bool:
        return bool(self._done_early) or any(self._queues.values())

    @staticmethod
    def _result(job: _Job) -> TransferResult:
        # A nominal 25 GB/s, so the stats path the real worker feeds is exercised too.
        return TransferResult(job.job_id, True, job.nbytes, job.nbytes / 25e9 if job.nbytes else 0.0)


def spec_bytes(per_group: Sequence[int]) -> Callable[[Any], int]:
    """Bytes a vLLM `GPULoadStoreSpec` moves (block ids per group, in group order), given each group's bytes per
    block id."""
    def nbytes(spec: Any) -> int:
        sizes = getattr(spec, "group_sizes", None) or [len(spec.block_ids)]
        return int(sum(n * per_group[min(i, len(per_group) - 1)] for i, n in enumerate(sizes)))

    return nbytes


def _bytes_per_gpu_block(kv_cache_config: Any) -> Callable[[Any], int]:
    """Bytes one GPU block id of each group moves, for the transfer stats (packed groups counted once)."""
    from offload_connector.groups import group_block_bytes

    return spec_bytes([group_block_bytes(g, kv_cache_config) for g in kv_cache_config.kv_cache_groups])


def _pointer_stand_in(kv_cache_config: Any) -> Any:
    """vLLM 0.34's offloading worker resolves block ids to device pointers (`resolve_device_pointers`) over the
    canonical KV caches `register_kv_caches` builds from the real tensors. The stand-in has one storage-less (meta)
    tensor per offloaded group, a block's bytes wide, so each block resolves to one copy of the group's block bytes.
    None before 0.34, whose worker takes block ids."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import get_offloading_group_ids
        from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor
    except ImportError:
        return None
    import torch

    from offload_connector.groups import group_block_bytes

    tensors, refs = [], []
    for g in get_offloading_group_ids(kv_cache_config):
        nbytes = group_block_bytes(kv_cache_config.kv_cache_groups[g], kv_cache_config)
        tensors.append(CanonicalKVCacheTensor(torch.empty((kv_cache_config.num_blocks, nbytes), dtype=torch.int8,
                                                          device="meta"), nbytes))
        refs.append([CanonicalKVCacheRef(len(tensors) - 1, nbytes)])
    return CanonicalKVCaches(tensors=tensors, group_data_refs=refs)


class VllmOffloadingWorkerSim:
    """The real WORKER-role OffloadingConnector over the worker KVCacheConfig, copy engine faked."""

    def __init__(self, vllm_config: Any, worker_kv_cache_config: Any, latency_steps: int = 1,
                 pickle_metadata: bool = True) -> None:
        self.connector = OffloadingConnector(vllm_config, KVConnectorRole.WORKER, worker_kv_cache_config)
        assert self.connector.connector_worker is not None
        self.engine = FakeOffloadingWorker(latency_steps, _bytes_per_gpu_block(worker_kv_cache_config))
        # What register_kv_caches -> _init_worker -> spec.get_worker(...) would have installed.
        self.connector.connector_worker.worker = self.engine
        stand_in = _pointer_stand_in(worker_kv_cache_config)
        if stand_in is not None:
            self.connector.connector_worker._kv_caches = stand_in
        self.pickle_metadata = pickle_metadata
        self.aggregator = KVOutputAggregator.from_connector(self.connector, world_size=1)

    def execute(self, scheduler_output: Any, step: int) -> Any:
        """The connector part of one execute_model; returns the KVConnectorOutput for this step."""
        from vllm.v1.outputs import KVConnectorOutput

        conn = self.connector
        meta = scheduler_output.kv_connector_metadata
        if self.pickle_metadata:
            meta = pickle.loads(pickle.dumps(meta))
        self.engine.now = step
        conn.handle_preemptions(meta)
        conn.bind_connector_metadata(meta)
        conn.start_load_kv(None)  # the forward would run here
        conn.wait_for_save()
        finished = set(scheduler_output.finished_req_ids or ())
        if hasattr(conn, "get_transfer_results"):
            res = conn.get_transfer_results(finished)
            sending, recving = res.finished_sending, res.finished_recving
        else:
            sending, recving = conn.get_finished(finished)
        out = KVConnectorOutput(finished_sending=set(sending or ()) or None,
                                finished_recving=set(recving or ()) or None,
                                kv_connector_worker_meta=conn.build_connector_worker_meta())
        conn.clear_connector_metadata()
        return out

    def pending(self) -> bool:
        return self.engine.pending() or bool(self.connector.connector_worker._unsubmitted_store_jobs)


def sorted_transfer_ids(kv_out: Any) -> None:
    """vLLM frees the blocks of `finished_sending` (and of finished requests in `finished_recving`) in iteration
    order; a set of str iterates in an order that changes with PYTHONHASHSEED, which would make a simulated run
    depend on the process's hash seed. vLLM only iterates these, so sorted lists stand in for its sets."""
    if kv_out is None:
        return
    for name in ("finished_sending", "finished_recving"):
        ids = getattr(kv_out, name, None)
        if ids:
            setattr(kv_out, name, sorted(ids))


class VllmOffloadingDriver(DraftCounts):
    """Steps a real vLLM scheduler whose connector is OffloadingConnector, with `VllmOffloadingWorkerSim`.

    Pipelining follows `SchedulerDriver`: with `batch_depth` 2 (async scheduling; EngineCore's batch queue) the next
    batch is scheduled before the previous one's output is applied. The worker runs a batch's connector calls when
    the batch is scheduled (the model runner executes it while the scheduler moves on).
    """

    def __init__(self, scheduler: Any, worker: VllmOffloadingWorkerSim, batch_depth: int | None = None,
                 spec_seed: int = 0) -> None:
        self.sched = scheduler
        self.worker = worker
        if batch_depth is None:
            cfg = scheduler.vllm_config
            batch_depth = getattr(cfg, "max_concurrent_batches", 1) if cfg.scheduler_config.async_scheduling else 1
        self.batch_depth = max(1, batch_depth)
        self._queue: deque[tuple[Any, list[str], list[list[int]], Any]] = deque()
        self.step_no = 0
        self.finished: set[str] = set()
        # Speculative decoding under async scheduling (AsyncScheduler schedules placeholder drafts): as
        # SchedulerDriver, a seeded random number (0..scheduled) of a request's drafts is accepted.
        self.drafts = DraftSampler(spec_seed)

    @property
    def pool(self) -> Any:
        return self.sched.kv_cache_manager.block_pool

    def add(self, requests: Iterable[Any]) -> None:
        for r in requests:
            self.sched.add_request(r)

    def step(self) -> Any:
        self.step_no += 1
        out = self.sched.schedule()
        kv_out = self.worker.execute(out, self.step_no)
        req_ids, sampled = self.drafts.sample(self.sched, out)
        self._queue.append((out, req_ids, sampled, kv_out))
        while self._queue and (len(self._queue) >= self.batch_depth or out.total_num_scheduled_tokens == 0):
            self._apply_oldest()
        return out

    def _apply_oldest(self) -> None:
        out, req_ids, sampled, kv_out = self._queue.popleft()
        mro = runner_output(req_ids, sampled, kv_out)
        mro = self.worker.aggregator.aggregate([mro])
        sorted_transfer_ids(mro.kv_connector_output)
        engine_outputs = self.sched.update_from_output(out, mro)
        for eco in engine_outputs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self.finished.add(o.request_id)

    def busy(self) -> bool:
        return bool(self._queue or self.sched.has_requests() or self.worker.pending())
