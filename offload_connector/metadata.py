"""Plain, picklable messages between the scheduler side and the worker side (nothing else crosses)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from offload_connector.keys import BlockKey
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass(frozen=True)
class TransferJob:
    """Per KV cache group g (one entry per group of the model, empty where the job moves nothing): copy
    `group_gpu_blocks[g][i]` to or from host slot `group_host_slots[g][i]`.

    Per group because that is how the copier takes them (a group is a set of KV tensors with one block id space);
    the flat views below are for bookkeeping that does not care which group a block is in."""
    job_id: int
    request_id: str
    group_gpu_blocks: tuple[tuple[int, ...], ...]
    group_host_slots: tuple[tuple[int, ...], ...]
    # A load only: disk tier entries to read into these host slots (some of the slots above) before the copy.
    disk_keys: tuple[BlockKey, ...] = ()
    disk_slots: tuple[int, ...] = ()
    # A load only: shared-tier blocks to fetch into these host slots before the copy.
    remote_keys: tuple[BlockKey, ...] = ()
    remote_slots: tuple[int, ...] = ()
    # A load only: report it failed without copying (the scheduler could not give it every host slot it needed).
    fail_reason: str = ""

    def __post_init__(self) -> None:
        if len(self.group_gpu_blocks) != len(self.group_host_slots) or any(
                len(b) != len(s) for b, s in zip(self.group_gpu_blocks, self.group_host_slots)):
            raise ValueError("a transfer job needs one host slot per GPU block in every group")
        if len(self.disk_keys) != len(self.disk_slots) or len(self.remote_keys) != len(self.remote_slots):
            raise ValueError("a transfer job needs one host slot per disk or shared-tier read")

    # `extra` is Any: the optional fields above (disk_keys .. fail_reason), each of its own type, for the constructor.
    @classmethod
    def from_columns(cls, job_id: int, request_id: str, num_groups: int, groups: Sequence[int],
                     gpu_blocks: Sequence[int], host_slots: Sequence[int], **extra: Any) -> "TransferJob":
        """From per-block columns (group, GPU block id, host slot), keeping each group's blocks in column order."""
        gpu: list[list[int]] = [[] for _ in range(num_groups)]
        slots: list[list[int]] = [[] for _ in range(num_groups)]
        for g, block, slot in zip(groups, gpu_blocks, host_slots, strict=True):
            gpu[g].append(block)
            slots[g].append(slot)
        return cls(job_id, request_id, tuple(map(tuple, gpu)), tuple(map(tuple, slots)), **extra)

    @property
    def num_blocks(self) -> int:
        return sum(map(len, self.group_gpu_blocks))

    @property
    def groups(self) -> tuple[int, ...]:
        """The group of each block of the flat views."""
        return tuple(g for g, blocks in enumerate(self.group_gpu_blocks) for _ in blocks)

    @property
    def gpu_blocks(self) -> tuple[int, ...]:
        """Every GPU block id, group by group."""
        return tuple(b for blocks in self.group_gpu_blocks for b in blocks)

    @property
    def host_slots(self) -> tuple[int, ...]:
        """Every host slot, in the order of `gpu_blocks`."""
        return tuple(s for slots in self.group_host_slots for s in slots)


@dataclass(frozen=True)
class TierWrite:
    """Write CPU-tier slot `host_slots[i]` to a second tier (disk or shared) under `keys[i]`, a (group, vLLM block
    hash) key; the slots stay pinned by the scheduler until every worker reported the job."""
    job_id: int
    keys: tuple[BlockKey, ...]
    host_slots: tuple[int, ...]


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
