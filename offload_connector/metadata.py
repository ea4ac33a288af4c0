"""Plain, picklable messages between the scheduler side and the worker side (nothing else crosses)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass(frozen=True)
class TransferJob:
    """Copy `gpu_blocks[i]` of KV cache group `groups[i]` to or from host slot `host_slots[i]`."""
    job_id: int
    request_id: str
    groups: tuple[int, ...]
    gpu_blocks: tuple[int, ...]
    host_slots: tuple[int, ...]

    def __post_init__(self) -> None:
        if not (len(self.groups) == len(self.gpu_blocks) == len(self.host_slots)):
            raise ValueError("a transfer job's groups, gpu_blocks and host_slots must have the same length")

    @property
    def num_blocks(self) -> int:
        return len(self.gpu_blocks)


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


@dataclass
class OffloadWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: store jobs that finished (or failed) since the last step."""
    stores_done: list[int] = field(default_factory=list)
    stores_failed: list[int] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        # With several workers a job is done only when every worker wrote its shard; the scheduler counts reports
        # per job (see StorePlanner), so aggregation just concatenates.
        assert isinstance(other, OffloadWorkerMetadata)
        return OffloadWorkerMetadata(self.stores_done + other.stores_done, self.stores_failed + other.stores_failed)
