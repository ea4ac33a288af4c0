"""Plain, picklable messages between the scheduler side and the worker side (nothing else crosses)."""

from __future__ import annotations

from dataclasses import dataclass, field

from offload_connector.keys import BlockKey
from offload_connector.transfer_jobs import TierWrite, TransferJob  # noqa: F401 (re-exported: the messages' home)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass(frozen=True)
class OffloadMetadata(KVConnectorMetadata):
    """One scheduler step's instructions for the workers."""
    step: int
    loads: tuple[TransferJob, ...] = ()
    stores: tuple[TransferJob, ...] = ()
    # Requests whose blocks the scheduler keeps alive until their stores finish: report each in
    # `finished_sending` once none of its store jobs is pending.
    delayed_free: tuple[str, ...] = ()
    # Store jobs whose source blocks this step hands to another request: the worker must finish reading them
    # before this step's forward writes those blocks.
    store_fences: tuple[int, ...] = ()
    # Load jobs reported finished since the last step (load_completion "ordered": possibly before their copies
    # landed): this step's forward may read their blocks, so it and every later one must run after the copies.
    load_fences: tuple[int, ...] = ()
    # The disk tier, applied in this order before this step's loads: forget everything (a cache reset), forget these
    # keys (evicted or failed; the scheduler decides, so every worker's tier holds the same keys), write these.
    disk_clear: bool = False
    disk_drops: tuple[BlockKey, ...] = ()
    disk_writes: tuple[TierWrite, ...] = ()
    # The shared tier: write these blocks' shards (every worker its own) to the shared store.
    remote_writes: tuple[TierWrite, ...] = ()
    remote_epoch: int = 0  # counts cache resets: the shared tier's keys live in a namespace per epoch
    # CPU-tier slots the scheduler hands out (ids 0..tier_slots-1): each worker checks its tier has as many.
    tier_slots: int = 0


@dataclass
class OffloadWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: store jobs that finished (or failed) since the last step."""
    stores_done: list[int] = field(default_factory=list)
    stores_failed: list[int] = field(default_factory=list)
    disk_writes_done: list[int] = field(default_factory=list)
    disk_writes_failed: list[int] = field(default_factory=list)
    remote_writes_done: list[int] = field(default_factory=list)
    remote_writes_failed: list[int] = field(default_factory=list)
    # Load jobs whose disk or shared-tier reads outlived load_timeout_s: reported failed while a read may still write
    # their CPU-tier slots (abandoned), and later every read of them returned (settled): the slots are free again.
    reads_abandoned: list[int] = field(default_factory=list)
    reads_settled: list[int] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        # With several workers a job is done only when every worker wrote its shard; the scheduler counts reports
        # per job (see StorePlanner), so aggregation just concatenates.
        assert isinstance(other, OffloadWorkerMetadata)
        return OffloadWorkerMetadata(self.stores_done + other.stores_done, self.stores_failed + other.stores_failed,
                                     self.disk_writes_done + other.disk_writes_done,
                                     self.disk_writes_failed + other.disk_writes_failed,
                                     self.remote_writes_done + other.remote_writes_done,
                                     self.remote_writes_failed + other.remote_writes_failed,
                                     self.reads_abandoned + other.reads_abandoned,
                                     self.reads_settled + other.reads_settled)
