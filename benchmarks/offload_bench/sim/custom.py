"""Arbitrary hand-built KV layouts on vLLM's real scheduler (for property tests and fuzzing).

Layouts are described as plain tuples so hypothesis can generate them: (kind, block_size, window_or_chunk).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Sequence

from offload_connector.groups import cdiv
from offload_bench.sim.layouts import build_vllm_config

GroupDesc = tuple[str, int, int]  # kind, block size, sliding window / attention chunk (0 for full)


def cold_need(groups: Sequence[GroupDesc], length: int, in_flight: int, spec_blocks: int = 0) -> int:
    """Blocks a request of `length` tokens holds across `groups` when nothing is shared, with `in_flight` tokens
    scheduled past a sliding window or chunk (what sizes a pool that can always run one such request); a Mamba group
    keeps `spec_blocks` speculative state blocks more."""
    total = 0
    for kind, bs, extent in groups:
        blocks = cdiv(length + 1, bs)
        if kind in ("sliding", "sliding_mla"):
            blocks = min(blocks, cdiv(extent - 1 + in_flight, bs) + 1)
        elif kind == "chunked":
            blocks = min(blocks, cdiv(extent + in_flight, bs))
        elif kind == "mamba":
            blocks = min(blocks, cdiv(bs + in_flight, bs) + 1) + spec_blocks
        total += blocks
    return total


def make_spec(kind: str, block_size: int, extent: int, spec_blocks: int = 0) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )

    common = dict(block_size=block_size, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    if kind == "full":
        return FullAttentionSpec(**common)
    if kind == "mla":
        return MLAAttentionSpec(**common)
    if kind == "sliding":
        return SlidingWindowSpec(**common, sliding_window=extent)
    if kind == "sliding_mla":
        return SlidingWindowMLASpec(**common, sliding_window=extent)
    if kind == "chunked":
        return ChunkedLocalAttentionSpec(**common, attention_chunk_size=extent)
    if kind == "mamba":
        # A recurrent state (conv + SSM) in vLLM's align mode, padded to the attention page as vLLM pads it.
        # `extent` 1: the layer exports a prefill checkpoint block (Mamba-2; GDN with FlashInfer's prefill).
        from vllm.v1.kv_cache_interface import MambaSpec

        page = FullAttentionSpec(**common).page_size_bytes
        return MambaSpec(block_size=block_size, shapes=((4, 32), (8, 32)), dtypes=(torch.bfloat16, torch.bfloat16),
                         page_size_padded=max(page, 768), mamba_cache_mode="align", num_speculative_blocks=spec_blocks,
                         num_prefill_checkpoint_blocks=1 if extent else 0,
                         prefill_checkpoint_alignment=1 if extent else None)
    raise ValueError(kind)


# Speculative methods the simulation drives, and how a V1-runner deployment runs each: CPU n-gram cannot run under
# async scheduling (vLLM turns it off: synchronous engine, drafts handed over by `update_draft_token_ids` after each
# step); GPU n-gram, a draft model and EAGLE run under async scheduling (AsyncScheduler, placeholder drafts). A draft
# model and EAGLE also reserve `num_speculative_tokens` lookahead slots past the scheduled tokens; EAGLE drops the last
# block of every local prefix-cache hit and reads one prefill token ahead. vLLM refuses EAGLE next to chunked local
# attention in a hybrid layout.
SPEC_METHODS = {"ngram": False, "ngram_gpu": True, "draft_model": True, "eagle": True}  # method -> async scheduling


def attach_speculative_config(vllm_config: Any, method: str, num_speculative_tokens: int) -> Any:
    """Give `vllm_config` the SpeculativeConfig a deployment with `--speculative-config` would have.

    Built offline (n-gram needs no draft model; the draft-model and EAGLE methods draft with the bundled tiny-llama
    config, which only has to resolve: the simulated layout carries no draft layers).
    The scheduler and the connector read it through VllmConfig's properties (`num_speculative_tokens`,
    `num_lookahead_tokens`, `max_in_flight_tokens`), so attaching it before the Scheduler is built is enough.
    """
    from vllm.config import SpeculativeConfig

    from offload_bench.sim.layouts import model_dir, resolve_hash_lookahead

    if method not in SPEC_METHODS:
        raise ValueError(f"speculative method {method!r} is not simulated; use one of {sorted(SPEC_METHODS)}")
    kw: dict[str, Any] = dict(method=method, num_speculative_tokens=num_speculative_tokens,
                              target_model_config=vllm_config.model_config,
                              target_parallel_config=vllm_config.parallel_config)
    if method in ("ngram", "ngram_gpu"):
        kw.update(prompt_lookup_max=4, prompt_lookup_min=2)
    else:
        kw["model"] = model_dir("tiny-llama")
    vllm_config.speculative_config = SpeculativeConfig(**kw)
    resolve_hash_lookahead(vllm_config)  # EAGLE on 0.34: hashes cover the drafter's next token (our connector opts in)
    assert vllm_config.num_speculative_tokens == num_speculative_tokens
    return vllm_config.speculative_config


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


def build_custom(groups: Sequence[GroupDesc], *, num_blocks: int, max_num_batched_tokens: int, max_model_len: int,
                 kv_transfer_config: Any, scheduler_cls: type | None = None, num_speculative_tokens: int = 0,
                 spec_method: str = "ngram", pipeline_parallel_size: int = 1, max_num_seqs: int | None = None,
                 max_num_inflight_kv_loads: int | None = None,
                 cache_aware_admission_window: int = 0) -> tuple[Any, int]:
    """A real scheduler over a hand-built layout. Returns (scheduler, hash_block_size).

    Without speculative decoding: the plain `Scheduler` over an async-scheduling config (the driver keeps a 2-deep
    batch queue). With `num_speculative_tokens` > 0: the engine vLLM would run for `spec_method` (see SPEC_METHODS):
    `Scheduler` with async scheduling off for CPU n-gram, `AsyncScheduler` otherwise.
    """
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    async_scheduling = SPEC_METHODS[spec_method] if num_speculative_tokens else True
    vc = build_vllm_config("tiny-llama", max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
                           num_gpu_blocks=num_blocks, kv_transfer_config=kv_transfer_config,
                           max_num_seqs=max_num_seqs or min(64, max_num_batched_tokens),
                           async_scheduling=async_scheduling)
    if max_num_inflight_kv_loads is not None:
        if not hasattr(vc.scheduler_config, "max_num_inflight_kv_loads"):
            raise ValueError(f"max_num_inflight_kv_loads needs vLLM >= 0.34 (this is {_vllm_version()})")
        vc.scheduler_config.max_num_inflight_kv_loads = max_num_inflight_kv_loads
    if cache_aware_admission_window:
        if not hasattr(vc.scheduler_config, "cache_aware_admission_window"):
            raise ValueError(f"cache_aware_admission_window needs vLLM >= 0.34 (this is {_vllm_version()})")
        vc.scheduler_config.cache_aware_admission_window = cache_aware_admission_window
    # Pipeline parallelism changes only how many batches vLLM keeps in flight (`max_concurrent_batches`, which the
    # driver's batch queue and the ledger's in-flight bound both read); the stages' layers are not simulated.
    vc.parallel_config.pipeline_parallel_size = pipeline_parallel_size
    if any(g[0] == "mamba" for g in groups):
        # vLLM runs Mamba groups in align mode only with prefix caching; both the scheduler (block-aligned chunks)
        # and the Mamba manager read the mode from the cache config.
        vc.cache_config.mamba_cache_mode = "align"
        vc.cache_config.enable_prefix_caching = True
    if num_speculative_tokens:
        attach_speculative_config(vc, spec_method, num_speculative_tokens)
        if scheduler_cls is None:
            scheduler_cls = AsyncScheduler if async_scheduling else Scheduler
    # vLLM gives a Mamba layer one speculative state block per draft token (`MambaBase.get_kv_cache_spec`).
    specs = [KVCacheGroupSpec([f"layers.{i}.attn"], make_spec(*g, spec_blocks=num_speculative_tokens))
             for i, g in enumerate(groups)]
    sizes = [g[1] for g in groups]
    sched_bs, hash_bs = math.lcm(*sizes), math.gcd(*sizes)
    kc = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=specs)
    if hasattr(kc, "hash_block_size"):
        kc.hash_block_size = hash_bs
    vc.cache_config.num_gpu_blocks = num_blocks
    cls = scheduler_cls or Scheduler
    sched = cls(vllm_config=vc, kv_cache_config=copy.deepcopy(kc), structured_output_manager=StructuredOutputManager(vc),
                block_size=sched_bs, hash_block_size=hash_bs)
    return sched, hash_bs
