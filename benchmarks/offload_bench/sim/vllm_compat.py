"""The few places where the simulation builds or reads vLLM objects whose shape changed between 0.32, 0.33 and 0.34.

Kept here so the drivers read the same on every release; the connector itself needs none of this.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from contextlib import contextmanager
from typing import Any, Iterator

from vllm.v1.outputs import ModelRunnerOutput

# 0.34 dropped `req_id_to_index`: the scheduler indexes outputs by the order of `req_ids`.
_HAS_REQ_ID_TO_INDEX = "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}


def runner_output(req_ids: list[str], sampled_token_ids: list[list[int]], kv_connector_output: Any) -> Any:
    """The `ModelRunnerOutput` an executor returns for one batch."""
    extra = {"req_id_to_index": {r: i for i, r in enumerate(req_ids)}} if _HAS_REQ_ID_TO_INDEX else {}
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled_token_ids,
                             kv_connector_output=kv_connector_output, **extra)


def waiting_count(sched: Any) -> int:
    """Requests waiting to be scheduled, in every waiting queue the release has: `waiting`, `kv_holding_waiting`
    (0.33) and `async_kv_waiting` (0.34: requests whose KV may load while the running batch is full)."""
    return sum(len(getattr(sched, name, ()) or ()) for name in ("waiting", "kv_holding_waiting", "async_kv_waiting"))


def startable_waiting_ids(sched: Any) -> list[str]:
    """The waiting requests vLLM would start this step if no connector held any back, in the order its scan takes
    them: the queue of requests holding blocks (0.34), then the waiting queue and 0.34's queue of async loads merged by
    arrival (its `_next_waiting_queue`). A request whose KV is still loading (`WAITING_FOR_REMOTE_KVS`) is skipped as
    vLLM skips it; the first one vLLM would not give blocks (`first_chunk_fits`) ends the list, because an allocation
    failure ends vLLM's scan (first come, first served: nothing behind it starts that step). A preempted request goes
    back to a waiting queue, so a running request that could not get its blocks is among them too."""
    from vllm.v1.request import RequestStatus

    # heapq.merge compares the two heads as vLLM does, and on equal arrival takes the waiting queue's (listed first).
    merged = heapq.merge(getattr(sched, "waiting", ()) or (), getattr(sched, "async_kv_waiting", ()) or (),
                         key=lambda r: r.arrival_time)
    out: list[str] = []
    for request in itertools.chain(getattr(sched, "kv_holding_waiting", ()) or (), merged):
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            continue
        if not first_chunk_fits(sched, request):
            break
        out.append(request.request_id)
    return out


def first_chunk_fits(sched: Any, request: Any) -> bool:
    """Whether vLLM would give `request` the blocks of its next chunk if it were scheduled now without any external
    tokens (its GPU prefix-cache hit counted): the chunk fits the free pool and, with `scheduler_reserve_full_isl`
    (vLLM's default since 0.33), so does its whole sequence by vLLM's own arithmetic (its admission cap included, as
    `allocate_slots` checks it before any chunk of a waiting request). vLLM's watermark and in-flight reservations
    are not counted: an upper bound on what vLLM could schedule. A request that fails this could not have run this
    step with or without a connector's verdict."""
    coord = sched.kv_cache_manager.coordinator
    if request.num_computed_tokens:
        local, blocks = request.num_computed_tokens, tuple([] for _ in coord.single_type_managers)
    else:
        blocks, local = coord.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)[:2]
    free = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    if getattr(sched.scheduler_config, "scheduler_reserve_full_isl", False):
        full = min(request.num_tokens, sched.max_model_len)
        whole = coord.get_num_blocks_to_allocate(request.request_id, full, blocks, 0, local, local, full,
                                                 apply_admission_cap=True,
                                                 prefill_end=max(request.num_prompt_tokens, request.num_tokens - 1))
        if whole > free:
            return False
    new = min(request.num_tokens - local, sched.scheduler_config.max_num_batched_tokens)
    lookahead = int(getattr(sched, "num_lookahead_tokens", 0) or 0)
    need = coord.get_num_blocks_to_allocate(request.request_id, local + new + lookahead, blocks, 0, local, local,
                                            local + new)
    return need <= free


@contextmanager
def cpu_configs() -> Iterator[None]:
    """Lets vLLM build a config for the CPU platform on an x86 machine without triton-cpu.

    vLLM 0.34's CPU platform refuses such a config at once ("vLLM on x86 CPUs requires Triton (triton-cpu)"), because
    its CPU model runner compiles Triton kernels; 0.32 and 0.33 only warned. A simulation builds configs, the
    scheduler and meta-device layers to read the KV cache layout from, and never runs a forward, so the check is
    answered for the duration of the construction only."""
    import vllm.triton_utils as triton_utils

    saved = triton_utils.HAS_TRITON
    triton_utils.HAS_TRITON = True
    try:
        yield
    finally:
        triton_utils.HAS_TRITON = saved


def has_inflight_load_cap() -> bool:
    """Whether this vLLM has `--max-num-inflight-kv-loads` and `may_load_async` (0.34)."""
    from vllm.config import SchedulerConfig

    return "max_num_inflight_kv_loads" in SchedulerConfig.__dataclass_fields__
