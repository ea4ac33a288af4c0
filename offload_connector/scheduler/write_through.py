"""Write-through jobs of a second tier (disk, shared): CPU-tier entries copied to it by every worker.

Each job pins its CPU-tier entries (they must not be evicted while a worker reads them) until every worker reported
it; one failed report ends it. A cache reset retires the jobs in flight (their entries' slots are released when they
report) and cancels those not sent yet. The tier-specific part (what is written, what a landed or failed write means)
stays with each tier's planner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from offload_connector.metadata import TierWrite
from offload_connector.scheduler.tier_index import TierIndex
from offload_connector.keys import BlockKey

Key = BlockKey


@dataclass
class _Writing:
    keys: tuple[Key, ...]
    host_slots: tuple[int, ...]
    reports: int = 0
    retired: bool = False  # issued before a reset: nothing to publish, only CPU-tier slots to release


class WriteThrough:
    def __init__(self, tier: TierIndex, reporters: int, max_writing: int) -> None:
        self.tier = tier
        self.reporters = reporters
        self.max_writing = max(1, max_writing)
        self._writing: dict[int, _Writing] = {}
        self._blocks = 0
        self._pending: list[TierWrite] = []
        self._release_after_clear: list[tuple[int, ...]] = []  # slots of writes a reset cancelled unsent

    def has_room(self, more: int) -> bool:
        """Whether one more block fits next to the `more` already chosen and every block being written."""
        return self._blocks + more < self.max_writing

    def issue(self, job_id: int, keys: Sequence[Key]) -> None:
        """Pin `keys`' readable CPU-tier entries and queue their write for the next metadata."""
        keys = tuple(keys)
        slots = tuple(self.tier.pin(keys, served=False))
        self._writing[job_id] = _Writing(keys, slots)
        self._blocks += len(keys)
        self._pending.append(TierWrite(job_id, keys, slots))

    def report(self, job_id: int, ok: bool) -> tuple[Key, ...] | None:
        """One worker reported `job_id`. Once it is over (every worker done, or one failed) its entries are unpinned
        and its keys returned for the tier to publish or forget; None while workers are still to report, and for a
        job unknown or retired by a reset (its slots are released here)."""
        w = self._writing.get(job_id)
        if w is None:
            return None
        if ok and w.reports + 1 < self.reporters:
            w.reports += 1
            return None
        del self._writing[job_id]
        self._blocks -= len(w.keys)
        if w.retired:
            self.tier.release_retired(w.host_slots)
            return None
        self.tier.unpin(list(w.keys))
        return w.keys

    def clear(self) -> None:
        """A cache reset, before `TierIndex.clear()`: jobs in flight are retired, jobs not sent are cancelled."""
        for write in self._pending:
            w = self._writing.pop(write.job_id)
            self._blocks -= len(w.keys)
            self._release_after_clear.append(w.host_slots)
        for w in self._writing.values():
            w.retired = True
        self._pending.clear()

    def after_tier_clear(self) -> None:
        """After `TierIndex.clear()`: release the retired slots of the jobs that were never sent."""
        for slots in self._release_after_clear:
            self.tier.release_retired(slots)
        self._release_after_clear.clear()

    def take(self) -> tuple[TierWrite, ...]:
        out, self._pending = tuple(self._pending), []
        return out

    def busy(self) -> bool:
        return bool(self._writing or self._pending)


def max_writing_blocks(cpu_slots: int) -> int:
    """Blocks a second tier may be writing at once: a quarter of the CPU tier (at least 16 blocks, at most half), so
    that a tier slower than the stores leaves most of the CPU tier evictable."""
    return max(1, min(cpu_slots // 2, max(16, cpu_slots // 4)))
