"""What the scheduler side asks of a second tier (the disk tier, the shared store), whatever it is.

`OffloadScheduler` and `AdmissionControl` hold the second tiers in order, nearest first, and call only these: extend
a lookup with the blocks the tier holds, read a load's blocks back into the CPU tier, write through what the CPU tier
stored, and report, reset and count. The worker side's half of the contract is `worker/second_tier.py`; the step
messages carry each tier's operations under its `name` (`transfer_jobs.TierStep`, `TierRead`). A tier's planner is
built by the factory registered in `offload_connector/second_tiers.py`, from a `PlannerContext`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from offload_connector.config import OffloadConfig
    from offload_connector.groups import GroupInfo
    from offload_connector.scheduler.tier_index import TierIndex
    from offload_connector.keys import BlockKey
    from offload_connector.metrics import OffloadStatsSink
    from offload_connector.scheduler.lookup import BlockKeys
    from offload_connector.transfer_jobs import TierStep

Ready = Callable[["BlockKey"], bool]


class SecondTierPlanner(Protocol):
    name: str  # its key in the step messages and its hit-source name
    local: bool  # its lookups are in-process (a side-effect-free probe may use them), not a network round trip

    # -- lookup and read-back
    def extend_ready(self, ready: Ready, request_id: str, keys: BlockKeys, groups: Sequence[GroupInfo],
                     alignment: int, spacing: int, upper: int, step: int) -> Ready:
        """`ready` plus the blocks this tier holds, for one request's lookup up to `upper` tokens."""

    def can_read(self, key: BlockKey) -> bool:
        """Whether this tier reads `key` back: at a load's issue, after the lookup that found it (the nearest tier
        that can, reads it); and, for a `local` tier only, in a side-effect-free probe outside any lookup."""

    def start_read(self, request_id: str, keys: list[BlockKey]) -> tuple[Callable[..., None], object]:
        """A load reads `keys` back from this tier: (the hook `JobBook.finish_load` calls as hook(handle, ok,
        retired), the handle)."""

    def forget(self, request_id: str) -> None:
        """The request finished (or its load was issued): drop what the tier kept for its lookups."""

    # -- write-through
    def stored(self, keys: Sequence[BlockKey], job_id: int) -> None:
        """`keys` just became readable CPU-tier entries (a store landed on every worker)."""

    def write_finished(self, job_id: int, ok: bool) -> None:
        """One worker reported a write job of this tier."""

    def take_step(self) -> TierStep:
        """This step's operations for the workers."""

    # -- reset, status, metrics
    def clear(self) -> None:
        """A cache reset, before `TierIndex.clear()`."""

    def after_tier_clear(self) -> None:
        """After `TierIndex.clear()`."""

    def busy(self) -> bool:
        """Something still needs an engine step."""

    def record_stats(self, stats: OffloadStatsSink) -> None:
        """This step's tier facts into the scheduler's metrics."""

    def describe(self) -> str:
        """One phrase for the start-up log line (where it is, how large, what it recovered)."""


@dataclass(frozen=True)
class PlannerContext:
    """What a scheduler-side tier factory gets."""
    config: OffloadConfig
    vllm_config: VllmConfig
    kv_cache_config: KVCacheConfig
    groups: tuple[GroupInfo, ...]
    tier: TierIndex  # the CPU tier's index: a second tier writes through from it and reads back into it
    reporters: int  # workers that report each job (TP x PP)
    slot_bytes: int  # one CPU-tier slot
