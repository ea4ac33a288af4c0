"""The hand-written per-layer KV cache spec tables that `sim/layouts.py` used before it derived specs from vLLM's
model code (as of commit 0d21083), kept only as the reference the derivation must reproduce exactly: the replay
results published for these models were produced on these layouts.

Sources: /work/shared/notes/models-and-traces.md §1-2 (Gemma 4 31B, DeepSeek-V4-Flash; measured with vLLM 0.33.0)
and vLLM's `gpt_oss.py` (window on even layers).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    get_kv_quant_mode,
)

_DSV4_BLOCK = 256
_DSV4_SWA_BLOCK = 64  # DeepseekV4SWACache default
_DSV4_CACHE_DTYPE = "fp8_ds_mla"  # what the CUDA FlashMLA-sparse attention writes back onto cache_config
_DSV4_BYTES_PER_TOKEN = 584  # 448 NoPE + 128 RoPE + 8 scale
_DSV4_ALIGN = 576


def _gemma4_specs(vc: Any) -> dict[str, KVCacheSpec]:
    hf = vc.model_config.hf_text_config
    n = hf.num_hidden_layers
    first_shared = n - (getattr(hf, "num_kv_shared_layers", 0) or 0)
    dtype = vc.model_config.dtype  # cache_dtype "auto"
    bs = vc.cache_config.block_size
    specs: dict[str, KVCacheSpec] = {}
    for i in range(first_shared):  # kv-shared layers read an earlier layer's cache and own none
        full = hf.layer_types[i] == "full_attention"
        per_layer = getattr(hf, "per_layer_config", None)
        if per_layer is not None:
            head, heads = per_layer[i].head_dim, per_layer[i].num_key_value_heads
        else:  # transformers without per_layer_config: same overrides, spelled out
            head = (getattr(hf, "global_head_dim", None) or hf.head_dim) if full else hf.head_dim
            heads = (getattr(hf, "num_global_key_value_heads", None) or hf.num_key_value_heads) if full \
                else hf.num_key_value_heads
        # attention_k_eq_v only shares the projection weight: V is still written to the cache.
        kw: dict[str, Any] = dict(block_size=bs, num_kv_heads=heads, head_size=head, dtype=dtype)
        name = f"model.layers.{i}.self_attn.attn"
        specs[name] = FullAttentionSpec(**kw) if full else SlidingWindowSpec(**kw, sliding_window=hf.sliding_window)
    return specs


def _gptoss_specs(vc: Any) -> dict[str, KVCacheSpec]:
    """gpt-oss (`GptOssForCausalLM`): every layer is plain GQA attention with sinks; even layers slide.

    vLLM's `OAIAttention._build_attention` gives layer i the window iff `i % 2 == 0` and ignores `layer_types`, so
    that is the rule used here; a config whose `layer_types` says otherwise is refused rather than silently
    replayed on a layout the HF model would not have. Sinks are per-head weights, not cache, so they do not change
    the spec. Both kinds get the primary block (16, FlashAttention's, which `get_kv_cache_spec` keeps for the window
    layers too when the backend runs it unsplit); equal heads and head size give equal pages, so the planner has
    nothing to scale. One GPU: all 8 KV heads per layer.
    """
    hf = vc.model_config.hf_text_config
    dtype = vc.model_config.dtype  # cache_dtype "auto"; the mxfp4 checkpoint quantizes experts, not the KV cache
    bs = vc.cache_config.block_size
    window = getattr(hf, "sliding_window", None)
    types = getattr(hf, "layer_types", None)
    specs: dict[str, KVCacheSpec] = {}
    for i in range(hf.num_hidden_layers):
        sliding = window is not None and i % 2 == 0
        if types is not None and (types[i] == "sliding_attention") != sliding:
            raise NotImplementedError(f"layer_types[{i}] is {types[i]!r}, but vLLM's gpt-oss applies the window to "
                                      "even layers only")
        kw: dict[str, Any] = dict(block_size=bs, num_kv_heads=hf.num_key_value_heads, head_size=hf.head_dim,
                                  dtype=dtype)
        name = f"model.layers.{i}.attn.attn"  # TransformerBlock.attn (OAIAttention) .attn (Attention)
        specs[name] = SlidingWindowSpec(**kw, sliding_window=window) if sliding else FullAttentionSpec(**kw)
    return specs


def _dsv4_specs(vc: Any) -> dict[str, KVCacheSpec]:
    hf = vc.model_config.hf_text_config
    fp8 = dict(dtype=torch.uint8, cache_dtype_str=_DSV4_CACHE_DTYPE, state_content_bytes=_DSV4_BYTES_PER_TOKEN,
               model_version="deepseek_v4", kv_quant_mode=get_kv_quant_mode(_DSV4_CACHE_DTYPE))
    one = dict(num_kv_heads=1, max_tp_shards=1, alignment=_DSV4_ALIGN)
    idx_head = hf.index_head_dim + hf.index_head_dim // 128 * 4  # fp8 + one fp32 scale per 128
    specs: dict[str, KVCacheSpec] = {}
    for i in range(hf.num_hidden_layers):  # MTP layers (the tail of compress_ratios) belong to the draft
        if getattr(hf, "compress_rates", None) and getattr(hf, "layer_types", None):
            ratio = max(1, hf.compress_rates.get(hf.layer_types[i], 0))
        else:
            ratio = max(1, hf.compress_ratios[i])
        p = f"model.layers.{i}.attn"
        specs[f"{p}.swa_cache"] = SlidingWindowMLASpec(
            block_size=_DSV4_SWA_BLOCK, head_size=hf.head_dim, sliding_window=hf.sliding_window, **one, **fp8)
        if ratio == 1:
            continue
        specs[p] = MLAAttentionSpec(block_size=_DSV4_BLOCK, head_size=hf.head_dim, tokens_per_state=ratio,
                                    **one, **fp8)
        coff = 2 if ratio == 4 else 1  # C4 compressors overlap two windows
        specs[f"{p}.compressor.state_cache"] = SlidingWindowMLASpec(
            block_size=4 if ratio == 4 else 8, head_size=2 * coff * hf.head_dim, dtype=torch.float32,
            sliding_window=coff * ratio, **one)
        if ratio == 4:  # only CSA layers carry the Lightning indexer
            specs[f"{p}.indexer.k_cache"] = MLAAttentionSpec(
                block_size=_DSV4_BLOCK, head_size=idx_head, dtype=torch.uint8, tokens_per_state=ratio, **one)
            specs[f"{p}.indexer.compressor.state_cache"] = SlidingWindowMLASpec(
                block_size=4, head_size=2 * coff * hf.index_head_dim, dtype=torch.float32,
                sliding_window=coff * ratio, **one)
    return specs


TABLES = {"gemma-4-31b": _gemma4_specs, "gpt-oss-20b": _gptoss_specs, "deepseek-v4-flash": _dsv4_specs}
