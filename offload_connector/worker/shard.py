"""This worker's shard of the engine: its ranks and the fingerprint every second tier files its blocks under, so a
block is only ever read back by a worker that holds the same model, layers, block bytes and TP/PP position."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from offload_connector.compat import lookahead_note, vllm_release
from offload_connector.disk import DiskFingerprint

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass
class WorkerRank:
    """This worker's place among the engine's workers (its disk directory and what its fingerprints record)."""
    dp: int = 0
    pp: int = 0
    tp: int = 0
    pp_size: int = 1
    tp_size: int = 1


def current_rank(vllm_config: VllmConfig) -> WorkerRank:
    """This worker's ranks, from vLLM's parallel groups (all 0 when they are not set up: tests, tools)."""
    from vllm.distributed import parallel_state as ps
    pc = getattr(vllm_config, "parallel_config", None)
    dp = int(getattr(pc, "data_parallel_rank", 0) or 0)
    pp_size = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
    tp_size = int(getattr(pc, "tensor_parallel_size", 1) or 1)
    if not ps.model_parallel_is_initialized():
        return WorkerRank(dp, 0, 0, pp_size, tp_size)
    return WorkerRank(dp, ps.get_pp_group().rank_in_group, ps.get_tensor_model_parallel_rank(), pp_size, tp_size)


def fingerprint_for(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, group_bytes: Sequence[int],
                    slot_bytes: int, rank: WorkerRank) -> DiskFingerprint:
    """What must match for a stored block to be this worker's: the model, each group's block bytes, block size and
    layers (so a PP stage never reads another's), the KV dtype, this worker's TP/PP position, the vLLM release and the
    block hashes' lookahead (0.34 with EAGLE/MTP)."""
    mc = getattr(vllm_config, "model_config", None)
    cc = getattr(vllm_config, "cache_config", None)
    groups = kv_cache_config.kv_cache_groups
    layers = hashlib.sha256(repr([list(g.layer_names) for g in groups]).encode()).hexdigest()[:16]
    return DiskFingerprint(
        model=str(getattr(mc, "model", "") or ""),
        group_block_bytes=tuple(group_bytes),
        block_sizes=tuple(int(g.kv_cache_spec.block_size) for g in groups),
        dtype=f"{getattr(cc, 'cache_dtype', 'auto')}/{getattr(mc, 'dtype', '')}",
        slot_bytes=slot_bytes,
        extra=f"tp {rank.tp}/{rank.tp_size} pp {rank.pp}/{rank.pp_size} layers {layers}" + lookahead_note(vllm_config),
        vllm=vllm_release(),
    )
