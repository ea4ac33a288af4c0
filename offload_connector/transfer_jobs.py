"""The copy jobs the scheduler side hands the worker side: plain frozen data, importable without vLLM (the worker's
transfer engine and the GPU kernel tests use them on machines that have torch and CUDA but no vLLM)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from offload_connector.keys import BlockKey


# The second tiers' names in the step messages (and in metrics and docs): `TierRead.tier`, the keys of
# `OffloadMetadata.tier_steps` and of the worker's `writes_done` / `writes_failed`.
DISK = "disk"
SHARED = "shared"


@dataclass(frozen=True)
class TierRead:
    """A load's blocks that one second tier reads back into CPU-tier slots (some of the job's) before the copy."""
    tier: str
    keys: tuple[BlockKey, ...]
    slots: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.slots):
            raise ValueError(f"a {self.tier} read needs one host slot per key")


@dataclass(frozen=True)
class TierStep:
    """One second tier's operations for one step, applied in this order before the step's loads: forget everything
    (a cache reset), forget these keys (evicted or failed: the scheduler decides, so every worker's tier holds the
    same keys), write these. `epoch` counts cache resets for a tier whose keys live in a namespace per reset."""
    clear: bool = False
    drops: tuple[BlockKey, ...] = ()
    writes: tuple[TierWrite, ...] = ()
    epoch: int = 0


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
    # A load only: blocks the second tiers read into their host slots before the copy, at most one read per tier.
    reads: tuple[TierRead, ...] = ()
    # A load only: report it failed without copying (the scheduler could not give it every host slot it needed).
    fail_reason: str = ""
    # A store only: issue it from vLLM's `wait_for_save`, which vLLM runs after sampling when drafts are on: it reads
    # a recurrent state that vLLM copies into its boundary block only after sampling (`Layout.state_behind_drafts`).
    after_sampling: bool = False

    def __post_init__(self) -> None:
        if len(self.group_gpu_blocks) != len(self.group_host_slots) or any(
                len(b) != len(s) for b, s in zip(self.group_gpu_blocks, self.group_host_slots)):
            raise ValueError("a transfer job needs one host slot per GPU block in every group")
        if len({r.tier for r in self.reads}) != len(self.reads):
            raise ValueError("a transfer job holds at most one read per second tier")

    # `extra` is Any: the optional fields above (reads, fail_reason, after_sampling), each of its own type.
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
