"""Arbitrary hand-built KV layouts on vLLM's real scheduler (for property tests and fuzzing).

Layouts are described as plain tuples so hypothesis can generate them: (kind, block_size, window_or_chunk).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Sequence

import offload_connector.sim  # noqa: F401  (platform environment first)
from offload_connector.sim.layouts import build_vllm_config

GroupDesc = tuple[str, int, int]  # kind, block size, sliding window / attention chunk (0 for full)


def make_spec(kind: str, block_size: int, extent: int) -> Any:
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
    raise ValueError(kind)


def build_custom(groups: Sequence[GroupDesc], *, num_blocks: int, max_num_batched_tokens: int, max_model_len: int,
                 kv_transfer_config: Any, scheduler_cls: type | None = None) -> tuple[Any, int]:
    """A real scheduler over a hand-built layout. Returns (scheduler, hash_block_size)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    vc = build_vllm_config("tiny-llama", max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
                           num_gpu_blocks=num_blocks, kv_transfer_config=kv_transfer_config,
                           max_num_seqs=min(64, max_num_batched_tokens))
    specs = [KVCacheGroupSpec([f"layers.{i}.attn"], make_spec(*g)) for i, g in enumerate(groups)]
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
