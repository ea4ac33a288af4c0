"""Where each worker's disk tier lives and how many slots it has: one function for both sides, so the scheduler
side (which decides what goes to disk) and every worker (which holds the bytes) count the same slots.

Plain Python: the scheduler side imports it.
"""
from __future__ import annotations

import os

from offload_connector.disk.format import HEADER_BYTES, slot_stride


def rank_dir(base: str, dp_rank: int, pp_rank: int, tp_rank: int) -> str:
    """One subdirectory per worker: each holds its own shard (TP) or layers (PP) of every block, and a data-parallel
    engine's workers never share a file with another engine's (the file is locked by the process that opened it)."""
    return os.path.join(base, f"dp{dp_rank}-pp{pp_rank}-tp{tp_rank}")


def disk_slots(disk_bytes: int, slot_bytes: int) -> int:
    """Slots of a `disk_bytes` disk tier whose slots hold `slot_bytes` (the CPU tier's slot size); at least 1 or a
    ValueError naming 'disk_bytes'. `DiskStore` sized with `disk_budget` of this count has exactly this many."""
    n = (disk_bytes - HEADER_BYTES) // slot_stride(slot_bytes)
    if n < 1:
        raise ValueError(f"kv_connector_extra_config: 'disk_bytes' ({disk_bytes}) is smaller than one disk slot "
                         f"({HEADER_BYTES + slot_stride(slot_bytes)} bytes with the header for this model)")
    return n


def disk_budget(num_slots: int, slot_bytes: int) -> int:
    """The `budget_bytes` that gives a `DiskStore` of `slot_bytes` slots exactly `num_slots` slots."""
    return HEADER_BYTES + num_slots * slot_stride(slot_bytes)
