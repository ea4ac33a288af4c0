"""The few places where the simulation builds or reads vLLM objects whose shape changed between 0.32, 0.33 and 0.34.

Kept here so the drivers read the same on every release; the connector itself needs none of this.
"""

from __future__ import annotations

import dataclasses
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
