"""Plain, picklable messages between the scheduler side and the worker side (nothing else crosses)."""

from __future__ import annotations

from dataclasses import dataclass, field

from offload_connector.transfer_jobs import TierRead, TierStep, TierWrite, TransferJob  # noqa: F401 (re-exported)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


_NOTHING = TierStep()


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
    # Each second tier's operations for this step, by tier name (`transfer_jobs.DISK`, `SHARED`): every tier the
    # scheduler runs is present each step (its epoch with it), an absent one has nothing to do.
    tier_steps: dict[str, TierStep] = field(default_factory=dict)
    # CPU-tier slots the scheduler hands out (ids 0..tier_slots-1): each worker checks its tier has as many.
    tier_slots: int = 0

    def tier_step(self, tier: str) -> TierStep:
        """`tier`'s operations this step (none when it is absent)."""
        return self.tier_steps.get(tier, _NOTHING)


@dataclass
class OffloadWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: store jobs that finished (or failed) since the last step."""
    stores_done: list[int] = field(default_factory=list)
    stores_failed: list[int] = field(default_factory=list)
    # Second-tier write jobs that finished or failed since the last step, by tier name.
    writes_done: dict[str, list[int]] = field(default_factory=dict)
    writes_failed: dict[str, list[int]] = field(default_factory=dict)
    # Load jobs whose disk or shared-tier reads outlived load_timeout_s: reported failed while a read may still write
    # their CPU-tier slots (abandoned), and later every read of them returned (settled): the slots are free again.
    reads_abandoned: list[int] = field(default_factory=list)
    reads_settled: list[int] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        # With several workers a job is done only when every worker wrote its shard; the scheduler counts reports
        # per job (see StorePlanner), so aggregation just concatenates.
        assert isinstance(other, OffloadWorkerMetadata)
        return OffloadWorkerMetadata(self.stores_done + other.stores_done, self.stores_failed + other.stores_failed,
                                     _merged(self.writes_done, other.writes_done),
                                     _merged(self.writes_failed, other.writes_failed),
                                     self.reads_abandoned + other.reads_abandoned,
                                     self.reads_settled + other.reads_settled)


def _merged(a: dict[str, list[int]], b: dict[str, list[int]]) -> dict[str, list[int]]:
    return {t: a.get(t, []) + b.get(t, []) for t in {*a, *b}}
