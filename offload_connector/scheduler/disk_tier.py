"""The disk tier, scheduler side: which keys every worker's disk tier holds, what to write there, what to forget.

The scheduler decides and the workers only execute, so every worker's tier holds the same keys: a `DiskIndex` is
the catalog (its slot numbers are its own, not the workers'; its counts are theirs, because every worker's tier has
the same number of slots (`disk.placement.disk_slots`) and sees the same drops and writes in the same order, so a
worker's tier never has to evict on its own). A key is readable once every worker reported its write.

- Write-through: when a store lands in the CPU tier its new entries are written to disk in the background (pinned
  in the CPU tier until every worker wrote them), so evicting a CPU-tier entry never waits for I/O. At most
  `max_writing` blocks (`write_through.max_writing_blocks`) are being written at once; past that, blocks are not written (counted), so a slow disk
  never pins the CPU tier full.
- A lookup sees a key as available when the CPU tier has it ready, or when the disk tier has it and the CPU tier
  does not (not even being stored or read back). A load of such keys reserves CPU-tier slots for them and the
  worker reads them from disk into those slots before the copy; when the load lands they are ready CPU-tier entries
  (promoted), so the next hit reads memory.
- Restart: the catalog starts with the keys every worker's file holds (read from the files, which the workers have
  already opened and checked against their fingerprint); keys only some workers hold are dropped everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

from offload_connector.disk.format import DiskFormatError
from offload_connector.disk.index import DiskEntry, DiskIndex, scan_directory
from offload_connector.disk.metrics import METRICS
from offload_connector.disk.placement import disk_slots, rank_dir
from offload_connector.log import get_logger
from offload_connector.transfer_jobs import DISK, TierStep
from offload_connector.scheduler.write_through import WriteThrough, max_writing_blocks
from offload_connector.scheduler.tier_index import TierIndex
from offload_connector.keys import BlockKey

if TYPE_CHECKING:
    from offload_connector.metrics import OffloadStatsSink
    from offload_connector.scheduler.second_tier import PlannerContext

logger = get_logger(__name__)

Key = BlockKey


@dataclass
class DiskCounters:
    writes_issued: int = 0  # blocks handed to the workers to write
    writes_landed: int = 0  # blocks every worker wrote
    write_failures: int = 0  # blocks some worker failed to write (dropped everywhere)
    write_skips: int = 0  # blocks not written: too many writes in flight, or every disk slot busy
    evictions: int = 0
    promoted_blocks: int = 0  # blocks read back into the CPU tier for a load that landed
    read_failures: int = 0  # loads with disk reads that failed (their disk keys are dropped)
    recovered: int = 0  # entries found in every worker's file at start-up
    dropped_at_start: int = 0  # entries found in some workers' files only


@dataclass
class ReadBack:
    """What a load reads from disk: the keys (also CPU-tier entries being filled) and the catalog entries it pins."""
    keys: list[Key] = field(default_factory=list)
    entries: list[DiskEntry] = field(default_factory=list)


class DiskTierPlanner:
    name = DISK
    local = True

    def __init__(self, tier: TierIndex, num_slots: int, reporters: int, max_writing: int) -> None:
        self.tier = tier
        self.catalog = DiskIndex(num_slots)
        self.counters = DiskCounters()
        self.writes = WriteThrough(tier, reporters, max_writing)
        self._pending_drops: list[Key] = []
        self._clear_pending = False
        self._path = ""  # the base directory recover() scanned

    # --------------------------------------------------------------- start-up
    def recover(self, base_dir: str, dp_rank: int, pp_size: int, tp_size: int) -> None:
        """Index what every worker's file holds (call after the workers opened their tiers). The catalog gets the
        fewest slots any worker's file has: under pipeline parallelism a stage's blocks (and so its slots) may be
        larger than the first stage's, which is the one the scheduler's KV cache config describes."""
        self._path = base_dir
        per_rank: list[dict[Key, tuple]] = []
        sizes: list[int] = []
        for pp in range(pp_size):
            for tp in range(tp_size):
                directory = rank_dir(base_dir, dp_rank, pp, tp)
                try:
                    header, records, _corrupt = scan_directory(directory, None)
                except (OSError, DiskFormatError) as exc:
                    logger.info("offload_connector: disk tier %s: nothing recovered (%s)", directory, exc)
                    per_rank.append({})
                    continue
                sizes.append(header.num_slots)
                per_rank.append({rec.key: (slot, rec) for slot, rec in records})
        if sizes and min(sizes) != self.catalog.num_slots:
            logger.info("offload_connector: disk tier: %d slots per worker (the smallest worker file), %d computed "
                        "here", min(sizes), self.catalog.num_slots)
            self.catalog = DiskIndex(min(sizes))
        common = set(per_rank[0])
        for found in per_rank[1:]:
            common &= set(found)
        partial = set().union(*per_rank) - common
        # Fewer slots than entries (a smaller budget than before): keep the most recently written.
        keep = sorted(common, key=lambda k: per_rank[0][k][1].seq)[-self.catalog.num_slots:]
        partial |= common - set(keep)
        self.catalog.restore([(i, per_rank[0][k][1]) for i, k in enumerate(keep)])
        self._pending_drops.extend(sorted(partial, key=repr))
        self.counters.recovered = len(keep)
        self.counters.dropped_at_start = len(partial)
        if keep or partial:
            logger.info("offload_connector: disk tier: recovered %d blocks held by all %d workers (%d dropped: held "
                        "by only some, or over the budget)", len(keep), len(per_rank), len(partial))

    # ----------------------------------------------------------------- lookup
    def readable(self, key: Key) -> bool:
        """On disk and readable back: every worker wrote it and the CPU tier has no entry for it (ready entries are
        read from memory; entries being stored or read back are not available yet)."""
        return self.catalog.contains(key) and not self.tier.has(key)

    def extend_ready(self, ready: Callable[[Key], bool], request_id: str, keys: object, groups: object,
                     alignment: int, spacing: int, upper: int, step: int) -> Callable[[Key], bool]:
        return lambda key: ready(key) or self.readable(key)

    def can_read(self, key: Key) -> bool:
        return self.readable(key)

    def start_read(self, request_id: str, keys: list[Key]) -> tuple[Callable[..., None], ReadBack]:
        return self.read_finished, self.pin_for_read(keys)

    def pin_for_read(self, keys: Sequence[Key]) -> ReadBack:
        back = ReadBack()
        for key in keys:
            entry = self.catalog.pin(key)
            assert entry is not None, f"disk tier entry {key!r} is not readable"
            back.keys.append(key)
            back.entries.append(entry)
        return back

    def read_finished(self, back: ReadBack, ok: bool, retired: bool = False) -> None:
        """A load that read `back` from disk was reported by the workers. On failure (a corrupt slot or an I/O
        error on some worker, which dropped it there) every key it read is forgotten everywhere. `retired`: the
        load was issued before a reset, whose clear already forgot its entries (they only lose their pin)."""
        for entry in back.entries:
            self.catalog.unpin(entry)
        if retired:
            return
        if ok:
            self.counters.promoted_blocks += len(back.keys)
            return
        self.counters.read_failures += 1
        for key in back.keys:
            if self.catalog.drop(key) is not None:
                self._pending_drops.append(key)

    # ----------------------------------------------------------------- writes
    def stored(self, keys: Sequence[Key], job_id: int) -> None:
        """`keys` just became readable CPU-tier entries: write the ones the disk tier lacks."""
        chosen: list[Key] = []
        for key in keys:
            if self.catalog.get(key) is not None:
                self.catalog.touch(key)
                continue
            if not self.writes.has_room(len(chosen)):
                self.counters.write_skips += 1
                continue
            slot, evicted = self.catalog.reserve(key)
            if slot is None:
                self.counters.write_skips += 1
                break
            self.counters.evictions += len(evicted)
            self._pending_drops.extend(evicted)
            chosen.append(key)
        if not chosen:
            return
        self.writes.issue(job_id, chosen)
        self.counters.writes_issued += len(chosen)

    def write_finished(self, job_id: int, ok: bool) -> None:
        """One worker reported disk write `job_id`. It lands when every worker reported it done; one failure drops
        its keys everywhere (the workers that wrote them forget them too)."""
        keys = self.writes.report(job_id, ok)
        if keys is None:
            return
        for key in keys:
            entry = self.catalog.get(key)
            if entry is None:
                continue
            if ok:
                self.catalog.commit(entry, 0, 0, 0, 0)
            else:
                self.catalog.abort(entry)
                self._pending_drops.append(key)
        if ok:
            self.counters.writes_landed += len(keys)
        else:
            self.counters.write_failures += len(keys)

    # ----------------------------------------------------------------- reset
    def clear(self) -> None:
        """Forget the whole disk tier (a cache reset; the workers bump their file's epoch, so a restart finds
        nothing either). Call before `TierIndex.clear()`: the CPU-tier entries pinned by writes are retired there,
        and each write releases its slots when reported (or now, for writes not yet sent)."""
        self.writes.clear()
        self._pending_drops.clear()
        self.catalog.clear()
        self._clear_pending = True

    def after_tier_clear(self) -> None:
        """After `TierIndex.clear()`: release the retired slots of writes that were never sent."""
        self.writes.after_tier_clear()

    # ------------------------------------------------------------------- step
    def take_step(self) -> TierStep:
        """This step's clear, drops and writes, for the metadata."""
        out = TierStep(clear=self._clear_pending, drops=tuple(self._pending_drops), writes=self.writes.take())
        self._clear_pending, self._pending_drops = False, []
        return out

    def busy(self) -> bool:
        return self.writes.busy() or bool(self._pending_drops or self._clear_pending)

    def used_slots(self) -> int:
        return self.catalog.used_slots()

    def record_stats(self, stats: OffloadStatsSink) -> None:
        c = self.counters
        stats.record_second_tier(METRICS, (c.evictions, c.promoted_blocks, c.write_skips),
                                 (self.used_slots(), self.catalog.num_slots))

    def forget(self, request_id: str) -> None:
        """Nothing kept per request (the shared tier caches its lookups per request)."""

    def describe(self) -> str:
        return f"{self._path} ({self.catalog.num_slots} slots per worker, {self.counters.recovered} recovered)"


def dp_rank_of(vllm_config: object) -> int:
    pc = getattr(vllm_config, "parallel_config", None)
    return int(getattr(pc, "data_parallel_rank", 0) or 0)


def open_planner(ctx: PlannerContext) -> DiskTierPlanner | None:
    """The registered scheduler-side factory (`second_tiers.py`): the disk tier's planner when `disk_path` is set,
    with what every worker's file already holds (the workers opened and checked their files when vLLM registered
    their KV caches, before it built the scheduler), so it is served from the first step."""
    config = ctx.config
    if config.disk_path is None:
        return None
    pc = ctx.vllm_config.parallel_config
    planner = DiskTierPlanner(ctx.tier, disk_slots(config.disk_bytes, ctx.slot_bytes), ctx.reporters,
                              max_writing_blocks(ctx.tier.capacity_slots))
    planner.recover(config.disk_path, dp_rank_of(ctx.vllm_config), pc.pipeline_parallel_size,
                    pc.tensor_parallel_size)
    return planner
