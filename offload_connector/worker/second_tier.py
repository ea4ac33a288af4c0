"""What the worker side asks of a second tier (the disk tier, the shared store), whatever it is.

`OffloadWorker` holds them by name (`name`, the tier's key in the step messages) and calls only these: this step's
planned operations, reads of a load's blocks into their CPU-tier slots, and what finished, moved and was refused since
the last step. A new second tier implements this contract, registers its factory in
`offload_connector/second_tiers.py`, and nothing in `worker/side.py` names it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from offload_connector.transfer_jobs import TierRead, TierStep

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from offload_connector.config import OffloadConfig
    from offload_connector.disk import DiskFingerprint
    from offload_connector.worker.shard import WorkerRank


@runtime_checkable
class ReadHandle(Protocol):
    """Completion of one read started by `read_back`: poll `done()`, then read `ok` and `error`."""

    def done(self) -> bool: ...

    @property
    def ok(self) -> bool: ...

    @property
    def error(self) -> str | None: ...


@runtime_checkable
class WorkerSecondTier(Protocol):
    name: str

    def apply(self, step: TierStep) -> None:
        """This step's operations (clear, drops, writes, epoch), as the scheduler planned them."""

    def read_back(self, read: TierRead) -> list[ReadHandle]:
        """Start reading a load's keys of this tier into their CPU-tier slots."""

    def finished_writes(self) -> tuple[list[int], list[int]]:
        """(done, failed) write jobs since the last call."""

    def io_deltas(self) -> tuple[int, int, int]:
        """(bytes written, bytes read, failed operations) since the last call."""

    def rejected(self) -> dict[str, int]:
        """Blocks refused on read so far, by reason (cumulative)."""

    def close(self) -> None:
        """Wait for the writes in flight and release the tier."""


@dataclass(frozen=True)
class ClientContext:
    """What a worker-side tier factory gets: the connector's config, this worker's CPU tier and its shard's identity
    (computed on first use: with no second tier turned on, nothing asks vLLM for this worker's ranks)."""
    config: OffloadConfig
    host: torch.Tensor  # the CPU tier: (num_slots, slot_bytes) uint8, slot i holds one block of one group
    group_bytes: tuple[int, ...]  # bytes of one block of each KV cache group (a slot's used prefix)
    slot_bytes: int  # this worker's slot size
    tier_slot_bytes: int  # the scheduler's slot size (its slot counts, e.g. the disk's, come from it)
    vllm_config: VllmConfig
    kv_cache_config: KVCacheConfig

    @functools.cached_property
    def rank(self) -> WorkerRank:
        from offload_connector.worker.shard import current_rank
        return current_rank(self.vllm_config)

    @functools.cached_property
    def fingerprint(self) -> DiskFingerprint:
        """This worker's shard (`worker/shard.py`)."""
        from offload_connector.worker.shard import fingerprint_for
        return fingerprint_for(self.vllm_config, self.kv_cache_config, self.group_bytes, self.slot_bytes, self.rank)
