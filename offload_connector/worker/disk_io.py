"""The disk tier on one worker: its file (`disk.DiskStore`) and the scheduler's instructions for it.

The scheduler side decides everything (which keys to write, drop, read back; `scheduler/disk_tier.py`); this worker
executes, in the order of each step's metadata: clear, drops, writes. A write reads a CPU-tier slot the scheduler
keeps pinned until every worker reported the write; a read-back fills a CPU-tier slot reserved for it, and the load
that needs it is copied to the GPU only once every read of it has landed and verified (`OffloadWorker.land_reads`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from offload_connector.disk.format import MAC_KEY_PURPOSE
from offload_connector.disk.placement import disk_budget, disk_slots, rank_dir
from offload_connector.log import get_logger
from offload_connector.transfer_jobs import DISK, TierRead, TierStep, TierWrite
from offload_connector.tier_auth import mac_key_from_file

if TYPE_CHECKING:
    import torch

    from offload_connector.disk import DiskFingerprint
    from offload_connector.disk.store import DiskIO, DiskStore
    from offload_connector.keys import BlockKey
    from offload_connector.worker.second_tier import ClientContext
    from offload_connector.worker.shard import WorkerRank

logger = get_logger(__name__)


class WorkerDiskTier:
    name = DISK

    def __init__(self, store: DiskStore, host: torch.Tensor, group_bytes: Sequence[int]) -> None:
        self.store = store
        self._host = host  # the CPU tier: a (num_slots, slot_bytes) uint8 CPU tensor
        self._group_bytes = list(group_bytes)
        self._writes: dict[int, list[DiskIO]] = {}
        self._seen = (0, 0, 0)

    @classmethod
    def open(cls, base_dir: str, disk_bytes: int, tier_slot_bytes: int, host: torch.Tensor, group_bytes: Sequence[int],
             fingerprint: DiskFingerprint, rank: WorkerRank, secret_file: str | None = None) -> "WorkerDiskTier":
        from offload_connector.disk import DiskStore

        directory = rank_dir(base_dir, rank.dp, rank.pp, rank.tp)
        # The slot count from the scheduler's own function and slot size, so both sides count the same slots.
        n = disk_slots(disk_bytes, tier_slot_bytes)
        mac_key = mac_key_from_file(secret_file, "disk_secret_file", MAC_KEY_PURPOSE)
        store = DiskStore(directory, fingerprint, disk_budget(n, fingerprint.slot_bytes), on_mismatch="reset",
                          mac_key=mac_key)
        logger.info("offload_connector worker side: disk tier %s: %d slots x %d bytes, %d entries recovered, %s, %s",
                    store.path, store.num_slots, fingerprint.slot_bytes, len(store),
                    "O_DIRECT" if store.direct else f"buffered I/O ({store.direct_reason})",
                    "slots tagged and verified with the secret" if mac_key is not None else "CRC-32 checks only")
        return cls(store, host, group_bytes)

    def _slot(self, key: BlockKey, slot: int) -> torch.Tensor:
        return self._host[slot, : self._group_bytes[int(key[0])]]

    # ------------------------------------------------------------------ step
    def apply(self, step: TierStep) -> None:
        """This step's clear, drops and writes, in that order (as the scheduler planned them)."""
        if step.clear:
            self.store.clear()
        for key in step.drops:
            self.store.drop(key)
        for write in step.writes:
            self._submit_write(write)

    def _submit_write(self, write: TierWrite) -> None:
        self._writes[write.job_id] = [self.store.write(key, self._slot(key, slot))
                                      for key, slot in zip(write.keys, write.host_slots)]

    def read_back(self, read: TierRead) -> list[DiskIO]:
        """Start reading a load's disk keys into their CPU-tier slots; one `DiskIO` handle per block."""
        return [self.store.read(key, self._slot(key, slot)) for key, slot in zip(read.keys, read.slots)]

    def finished_writes(self) -> tuple[list[int], list[int]]:
        """(done, failed) write jobs since the last call. A write of a key the tier already held counts as done."""
        done, failed = [], []
        for job_id, ios in list(self._writes.items()):
            if all(io.done() for io in ios):
                del self._writes[job_id]
                (done if all(io.ok for io in ios) else failed).append(job_id)
        return done, failed

    def io_deltas(self) -> tuple[int, int, int]:
        """(bytes written, bytes read, failed I/Os) since the last call."""
        s = self.store.stats()
        now = (s.bytes_written, s.bytes_read, s.write_errors + s.read_errors + s.corrupt_dropped
               + s.rejected_unauthenticated + s.rejected_mac)
        delta = tuple(max(0, a - b) for a, b in zip(now, self._seen))
        self._seen = now
        return delta  # type: ignore[return-value]

    def rejected(self) -> dict[str, int]:
        """Slots dropped by reason so far (cumulative): corrupt, unauthenticated, mac."""
        s = self.store.stats()
        return {"corrupt": s.corrupt_dropped, "unauthenticated": s.rejected_unauthenticated, "mac": s.rejected_mac}

    def pending(self) -> int:
        return len(self._writes)

    def close(self) -> None:
        self.store.close()


def open_client(ctx: ClientContext) -> WorkerDiskTier | None:
    """The registered worker-side factory (`second_tiers.py`): this worker's disk tier when `disk_path` is set."""
    config = ctx.config
    if config.disk_path is None:
        return None
    return WorkerDiskTier.open(config.disk_path, config.disk_bytes, ctx.tier_slot_bytes, ctx.host, ctx.group_bytes,
                               ctx.fingerprint, ctx.rank, secret_file=config.disk_secret_file)


__all__ = ["WorkerDiskTier", "open_client"]
