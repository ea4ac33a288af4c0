"""Scheduler-side KV cache layouts that vLLM would build for a model, built offline on CPU.

Per-layer `KVCacheSpec`s are derived from a bare HF `config.json` exactly as the model code on a CUDA machine would
return them (Gemma 4 and gpt-oss through `Attention.get_kv_cache_spec` with FlashAttention; DeepSeek V4 through the
FlashMLA-sparse `fp8_ds_mla` path). Grouping, block ids and block sizes are then left to vLLM's own planner, in
EngineCore's order, so a change to vLLM's grouping shows up here instead of being frozen into a hand-written table.
"""

from __future__ import annotations

import copy
import inspect
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# vLLM picks its platform on first use; without these it fails to infer a device or tries the hub.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.v1.attention.backends import utils as _attn_utils  # noqa: E402
from vllm.v1.core import kv_cache_utils as _kcu  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    get_kv_quant_mode,
)
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

try:  # 0.33 moved the planner out of kv_cache_utils
    from vllm.v1.core import kv_cache_planning as _planner
except ImportError:  # 0.32
    _planner = _kcu

MODELS_DIR = Path(__file__).parent / "models"

# DeepSeek V4's sparse-MLA and indexer backends accept only this block (both CUDA and CPU platforms force it).
_DSV4_BLOCK = 256
_DSV4_SWA_BLOCK = 64  # DeepseekV4SWACache default
_DSV4_CACHE_DTYPE = "fp8_ds_mla"  # what the CUDA FlashMLA-sparse attention writes back onto cache_config
_DSV4_BYTES_PER_TOKEN = 584  # 448 NoPE + 128 RoPE + 8 scale
_DSV4_ALIGN = 576


@dataclass(frozen=True)
class SimModel:
    """What a caller needs to build a Scheduler for a simulated model."""

    name: str
    model_dir: str
    kv_cache_config: KVCacheConfig  # scheduler view: flattened specs
    worker_kv_cache_config: KVCacheConfig  # planner output: packed specs, kv_cache_tensors filled
    scheduler_block_size: int
    hash_block_size: int
    max_model_len: int


def model_dir(name_or_path: str) -> str:
    """Directory holding config.json for a bundled model name, a directory or a config.json path."""
    if (MODELS_DIR / name_or_path / "config.json").is_file():
        return str(MODELS_DIR / name_or_path)
    p = Path(name_or_path)
    if p.is_file() and p.name == "config.json":
        return str(p.parent)
    if (p / "config.json").is_file():
        return str(p)
    known = sorted(d.name for d in MODELS_DIR.iterdir() if (d / "config.json").is_file())
    raise FileNotFoundError(f"{name_or_path!r} is neither a bundled model {known} nor holds a config.json")


def _is_dsv4(hf: Any) -> bool:
    return getattr(hf, "model_type", None) == "deepseek_v4"


def build_vllm_config(
    name_or_path: str,
    *,
    max_model_len: int,
    max_num_batched_tokens: int,
    max_num_seqs: int = 256,
    num_gpu_blocks: int,
    async_scheduling: bool = True,
    kv_transfer_config: KVTransferConfig | None = None,
    num_speculative_tokens: int = 0,
    enable_prefix_caching: bool = True,
) -> VllmConfig:
    """A VllmConfig as a CUDA deployment would have it, with the CPU platform's overrides undone."""
    if num_speculative_tokens:
        # MTP would add draft layers and SWA retention that need the draft model's config resolved.
        raise NotImplementedError("speculative decoding is not simulated")
    mc = ModelConfig(model=model_dir(name_or_path), skip_tokenizer_init=True, dtype="bfloat16",
                     max_model_len=max_model_len)
    dsv4 = _is_dsv4(mc.hf_config)
    block = _DSV4_BLOCK if dsv4 else 16  # 16 = CUDA default block size
    vc = VllmConfig(
        model_config=mc,
        cache_config=CacheConfig(block_size=block, enable_prefix_caching=enable_prefix_caching),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            enable_chunked_prefill=True, is_encoder_decoder=False, async_scheduling=async_scheduling,
            disable_hybrid_kv_cache_manager=False),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=kv_transfer_config,
    )
    # The CPU platform turns off async scheduling, and for MLA models chunked prefill and prefix caching (raising
    # the batch to max_model_len); a GPU deployment keeps them, so put them back.
    sc, cc = vc.scheduler_config, vc.cache_config
    sc.async_scheduling = async_scheduling
    sc.enable_chunked_prefill = True
    sc.max_num_batched_tokens = max_num_batched_tokens
    sc.max_num_encoder_input_tokens = sc.encoder_cache_size = max_num_batched_tokens
    sc.disable_hybrid_kv_cache_manager = False
    cc.enable_prefix_caching = enable_prefix_caching
    cc.block_size = block
    if dsv4:
        cc.cache_dtype = _DSV4_CACHE_DTYPE
    cc.num_gpu_blocks = num_gpu_blocks
    return vc


def _gemma4_specs(vc: VllmConfig) -> dict[str, KVCacheSpec]:
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


def _gptoss_specs(vc: VllmConfig) -> dict[str, KVCacheSpec]:
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


def _dsv4_specs(vc: VllmConfig) -> dict[str, KVCacheSpec]:
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


def _attention_backends(dsv4: bool) -> list[type]:
    """The CUDA backends whose declared KV layouts the worker would report."""
    if dsv4:
        from vllm.models.deepseek_v4.compressor import CompressorBackend
        from vllm.v1.attention.backends.mla.indexer import DeepseekV4IndexerBackend
        from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWABackend
        return [DeepseekSparseSWABackend, CompressorBackend, DeepseekV4IndexerBackend]
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    return [FlashAttentionBackend]


def layer_specs(vllm_config: VllmConfig) -> dict[str, KVCacheSpec]:
    """Per-layer specs, keyed by layer name, that the model's attention layers would report."""
    if _is_dsv4(vllm_config.model_config.hf_config):
        return _dsv4_specs(vllm_config)
    if getattr(vllm_config.model_config.hf_text_config, "model_type", "").startswith("gemma4"):
        return _gemma4_specs(vllm_config)
    if getattr(vllm_config.model_config.hf_text_config, "model_type", "") == "gpt_oss":
        return _gptoss_specs(vllm_config)
    raise NotImplementedError(f"no layer specs for {vllm_config.model_config.architectures}")


def build_sim_model(name_or_path: str, *, vllm_config: VllmConfig, num_blocks: int) -> SimModel:
    """Plan the KV cache with vLLM's planner, in EngineCore._initialize_kv_caches' order.

    Updates `vllm_config` as EngineCore does (layout, num_gpu_blocks[_override], block_size). Raises vLLM's
    ValueError when `num_blocks` cannot hold one `max_model_len` request.
    """
    vc, cc = vllm_config, vllm_config.cache_config
    mdir = model_dir(name_or_path)
    if Path(vc.model_config.model).resolve() != Path(mdir).resolve():
        raise ValueError(f"vllm_config was built for {vc.model_config.model}, not {mdir}")
    specs = layer_specs(vc)
    register_all_kvcache_specs(vc)
    backends = _attention_backends(_is_dsv4(vc.model_config.hf_config))
    layouts = [m.name for m in _attn_utils.get_supported_kv_cache_layouts(backends)]
    _attn_utils.resolve_kv_cache_layout(vc, [layouts], list(specs.values()))
    # The override is vLLM's own way to pin the pool size independently of the profiled memory.
    cc.num_gpu_blocks_override = num_blocks
    if "global_kv_cache_groups" in inspect.signature(_planner.get_kv_cache_configs).parameters:
        groups = _planner.get_global_kv_cache_groups(vc, [specs])
        if hasattr(vc, "adjust_dcp_kv_cache_interleave_size"):
            vc.adjust_dcp_kv_cache_interleave_size(groups)
        worker_cfgs = _planner.get_kv_cache_configs(vc, [specs], [0], groups)
    else:  # 0.32 groups inside get_kv_cache_configs
        worker_cfgs = _planner.get_kv_cache_configs(vc, [specs], [0])
    for c in worker_cfgs:
        c.kv_cache_layout = cc.kv_cache_layout
    sched_cfg = _kcu.generate_scheduler_kv_cache_config(worker_cfgs)
    cc.num_gpu_blocks = sched_cfg.num_blocks
    groups = sched_cfg.kv_cache_groups
    participating = [g.kv_cache_spec.block_size for g in groups if g.kv_cache_spec.prefix_cacheable]
    cc.block_size = min(participating or [g.kv_cache_spec.block_size for g in groups])
    _kcu.update_kv_cache_capacity(vc, sched_cfg)
    vc.validate_block_size()
    sched_bs, hash_bs = _kcu.resolve_kv_cache_block_sizes(sched_cfg, vc)
    align = _kcu.resolve_cache_hit_alignment_tokens(sched_cfg, vc, sched_bs, hash_bs)
    for c in (*worker_cfgs, sched_cfg):
        c.hash_block_size = hash_bs
        c.cache_hit_alignment_tokens = align
    return SimModel(name=Path(mdir).name, model_dir=mdir, kv_cache_config=sched_cfg,
                    worker_kv_cache_config=worker_cfgs[0], scheduler_block_size=sched_bs, hash_block_size=hash_bs,
                    max_model_len=vc.model_config.max_model_len)


def build_scheduler(sim: SimModel, vllm_config: VllmConfig, *, scheduler_cls: type | None = None,
                    log_stats: bool = False) -> Scheduler:
    """A real vLLM scheduler over `sim`'s pool; the class defaults to what EngineCore would pick."""
    cls = scheduler_cls or vllm_config.scheduler_config.get_scheduler_cls()
    vllm_config.cache_config.num_gpu_blocks = sim.kv_cache_config.num_blocks
    return cls(vllm_config=vllm_config, kv_cache_config=copy.deepcopy(sim.kv_cache_config),
               structured_output_manager=StructuredOutputManager(vllm_config), block_size=sim.scheduler_block_size,
               hash_block_size=sim.hash_block_size, log_stats=log_stats)
