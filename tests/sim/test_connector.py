"""The connector class as vLLM builds it: both roles, config errors at start-up, unsupported layouts refused."""

import pytest
import torch

from offload_connector.config import ConfigError
from offload_connector.groups import UnsupportedLayoutError
from offload_bench.sim.custom import build_custom
from offload_bench.sim.scenarios import connector_config


def test_constructs_in_both_roles_and_is_hma():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, SupportsHMA

    from offload_connector import OffloadConnector

    sched, _ = build_custom([("full", 32, 0), ("sliding", 16, 64)], num_blocks=300, max_num_batched_tokens=256,
                            max_model_len=4096, kv_transfer_config=connector_config("exact", 1 << 30))
    conn = sched.get_kv_connector()
    assert isinstance(conn, OffloadConnector) and isinstance(conn, SupportsHMA)
    assert conn.scheduler_side is not None and conn.worker_side is None
    assert conn.requires_kv_delivery is False
    worker = OffloadConnector(sched.vllm_config, KVConnectorRole.WORKER, sched.kv_cache_config)
    assert worker.worker_side is not None and worker.scheduler_side is None
    snap = conn.ledger_snapshot()
    assert snap.free_blocks == 299 and snap.rows == () and len(snap.groups) == 2


def test_bad_config_fails_at_startup_with_key_name():
    with pytest.raises(ConfigError, match="'reservation' must be one of"):
        build_custom([("full", 32, 0)], num_blocks=300, max_num_batched_tokens=256, max_model_len=4096,
                     kv_transfer_config=connector_config("fast", 1 << 30))


def test_cpu_bytes_smaller_than_a_block_is_refused():
    with pytest.raises(ValueError, match="smaller than one host block"):
        build_custom([("full", 32, 0)], num_blocks=300, max_num_batched_tokens=256, max_model_len=4096,
                     kv_transfer_config=connector_config("exact", 10))


def _hybrid(**mamba):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    groups = [KVCacheGroupSpec(["a"], FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=64,
                                                        dtype=torch.bfloat16)),
              KVCacheGroupSpec(["m0", "m1"], MambaSpec(block_size=32, shapes=((4, 4), (2, 8)),
                                                       dtypes=(torch.float32, torch.float32), **mamba))]
    return KVCacheConfig(num_blocks=10, kv_cache_tensors=[], kv_cache_groups=groups)


def test_mamba_state_outside_align_mode_is_refused_with_reason():
    """`mamba_cache_mode: "none"` keeps one state per request and gives no request a block hash."""
    from offload_connector.groups import describe_groups

    with pytest.raises(UnsupportedLayoutError, match="MambaSpec.*mamba_cache_mode 'none'.*'align'"):
        describe_groups(_hybrid(), 2048)
    with pytest.raises(UnsupportedLayoutError, match="MambaSpec.*mamba_cache_mode 'none'"):
        describe_groups(_hybrid(num_speculative_blocks=2), 2048)


def test_speculative_state_blocks_are_in_the_ceiling():
    """Under EAGLE/MTP vLLM keeps `num_speculative_blocks` more Mamba blocks at the end of the table, once per
    request whatever the batches in flight; lookahead slots are not allocated in align mode."""
    from offload_connector.groups import describe_groups

    _, plain = describe_groups(_hybrid(mamba_cache_mode="align"), 512, lookahead_tokens=2, batches_in_flight=2)
    _, spec = describe_groups(_hybrid(mamba_cache_mode="align", num_speculative_blocks=2), 512, lookahead_tokens=2,
                              batches_in_flight=2)
    assert (plain.spec_blocks, spec.spec_blocks) == (0, 2)
    assert plain.live_ceiling == 3 and spec.live_ceiling == 5


def test_a_mamba_group_in_align_mode_restores_one_state_block():
    from offload_connector.groups import GroupKind, describe_groups

    full, mamba = describe_groups(_hybrid(mamba_cache_mode="align"), 512, batches_in_flight=2)
    assert mamba.kind is GroupKind.MAMBA and mamba.recycling and not full.recycling
    assert mamba.block_bytes == 2 * (4 * 4 + 2 * 8) * 4  # the states, not a padded page
    assert [mamba.skipped_tokens(n) for n in (0, 1, 32, 33)] == [0, 0, 31, 32]
    assert list(mamba.restore_range(96)) == [2] and list(mamba.restore_range(100)) == []
    # The state it resumes from, plus the chunk-end block of each of the two batches in flight.
    assert mamba.live_ceiling == 3
    _, ckpt = describe_groups(_hybrid(mamba_cache_mode="align", num_prefill_checkpoint_blocks=1,
                                      prefill_checkpoint_alignment=1), 512, batches_in_flight=2)
    assert ckpt.live_ceiling == 5
    # Never above what a 2-token window spans over the tokens in flight (one 32-token batch: 2 blocks).
    _, small = describe_groups(_hybrid(mamba_cache_mode="align"), 32, batches_in_flight=4)
    assert small.live_ceiling == 2
