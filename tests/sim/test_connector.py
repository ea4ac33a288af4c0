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


def test_mamba_layout_is_refused_with_reason():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    from offload_connector.groups import describe_groups

    groups = [KVCacheGroupSpec(["a"], FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=64,
                                                        dtype=torch.bfloat16)),
              KVCacheGroupSpec(["m"], MambaSpec(block_size=32, shapes=((4, 4),), dtypes=(torch.float32,)))]
    with pytest.raises(UnsupportedLayoutError, match="MambaSpec"):
        describe_groups(KVCacheConfig(num_blocks=10, kv_cache_tensors=[], kv_cache_groups=groups), 2048)
