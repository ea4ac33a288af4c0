"""The disk tier's index: which slot of the disk file holds which `(group index, vLLM block hash)` key, LRU order,
and the scan that rebuilds it from the file after a restart.

Plain Python (os, struct, zlib): the scheduler side imports it without torch or numpy, and can rebuild the same
index from a directory (`scan_directory`) as the worker's `DiskStore` does. Not thread safe on its own; `DiskStore`
calls it under one lock.

An entry is "writing" (slot reserved, not readable) from `reserve` to `commit`, then "ready". A read pins it; a
pinned or writing entry is never an eviction victim. `drop` of a pinned entry takes it out of the index at once
but keeps its slot until the last `unpin` ("retired"), so no write can reuse bytes a read is still copying.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterator

from offload_connector.disk.format import (
    FILE_NAME, HEADER_BYTES, RECORD_BYTES, DiskFingerprint, FingerprintMismatch, Header, Record, align_up,
    is_blank, unpack_header, unpack_record,
)
from offload_connector.keys import BlockKey

Key = BlockKey


@dataclass(eq=False)
class DiskEntry:
    key: Key
    slot: int
    length: int = 0
    crc: int = 0
    seq: int = 0
    epoch: int = 0
    ready: bool = False
    pins: int = 0
    dropped: bool = field(default=False, repr=False)


class DiskIndex:
    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError("the disk tier must hold at least one slot")
        self.num_slots = num_slots
        self._entries: dict[Key, DiskEntry] = {}
        self._lru: OrderedDict[Key, None] = OrderedDict()  # ready entries, least recently used first
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out low slots first
        self._retired: set[int] = set()
        self.evictions = 0

    # ---------------------------------------------------------------- queries
    def get(self, key: Key) -> DiskEntry | None:
        return self._entries.get(key)

    def contains(self, key: Key) -> bool:
        e = self._entries.get(key)
        return e is not None and e.ready

    def keys(self) -> list[Key]:
        """Readable keys, least recently used first."""
        return list(self._lru)

    def __len__(self) -> int:
        return len(self._lru)

    def used_slots(self) -> int:
        return self.num_slots - len(self._free)

    # ----------------------------------------------------------------- writes
    def reserve(self, key: Key) -> tuple[int | None, list[Key]]:
        """A slot for a new entry (evicting the least recently used unpinned ready entries as needed), and the keys
        evicted. (None, []) when every slot is being written or read. The key must not be present."""
        assert key not in self._entries, key
        evicted: list[Key] = []
        if not self._free:
            victim = next((k for k in self._lru if self._entries[k].pins == 0), None)
            if victim is None:
                return None, evicted
            self._remove(self._entries[victim])
            self.evictions += 1
            evicted.append(victim)
        slot = self._free.pop()
        self._entries[key] = DiskEntry(key=key, slot=slot)
        return slot, evicted

    def commit(self, entry: DiskEntry, length: int, crc: int, seq: int, epoch: int) -> bool:
        """The write of `entry` landed: make it readable (most recently used). False if it was dropped meanwhile."""
        if entry.dropped:
            return False
        entry.length, entry.crc, entry.seq, entry.epoch, entry.ready = length, crc, seq, epoch, True
        self._lru[entry.key] = None
        return True

    def abort(self, entry: DiskEntry) -> None:
        """The write of `entry` failed: free its slot."""
        if not entry.dropped:
            self._remove(entry)

    # ------------------------------------------------------------------ reads
    def pin(self, key: Key) -> DiskEntry | None:
        """Pin a readable entry for a read and mark it most recently used; None when absent or not ready."""
        e = self._entries.get(key)
        if e is None or not e.ready:
            return None
        e.pins += 1
        self._lru.move_to_end(key)
        return e

    def touch(self, key: Key) -> None:
        """Mark a readable entry most recently used (a store offered it again)."""
        if key in self._lru:
            self._lru.move_to_end(key)

    def unpin(self, entry: DiskEntry) -> None:
        entry.pins -= 1
        if entry.dropped and entry.pins == 0 and entry.slot in self._retired:
            self._retired.discard(entry.slot)
            self._free.append(entry.slot)

    # --------------------------------------------------------------- removal
    def drop(self, key: Key) -> DiskEntry | None:
        e = self._entries.get(key)
        if e is not None:
            self._remove(e)
        return e

    def clear(self) -> list[DiskEntry]:
        """Forget every entry (pinned ones keep their slot until unpinned). Returns them."""
        gone = list(self._entries.values())
        for e in gone:
            self._remove(e)
        return gone

    def _remove(self, e: DiskEntry) -> None:
        del self._entries[e.key]
        self._lru.pop(e.key, None)
        e.dropped = True
        if e.pins > 0:
            self._retired.add(e.slot)
        else:
            self._free.append(e.slot)

    # -------------------------------------------------------------- recovery
    def restore(self, records: list[tuple[int, Record]]) -> list[int]:
        """Load (slot, record) pairs found on disk into an empty index, oldest sequence first so LRU order is write
        order. Of two records of one key the newer wins. Returns the slots left free by duplicates."""
        assert not self._entries
        used: set[int] = set()
        dup_slots: list[int] = []
        for slot, rec in sorted(records, key=lambda sr: sr[1].seq):
            old = self._entries.get(rec.key)
            if old is not None:
                del self._entries[rec.key]
                self._lru.pop(rec.key, None)
                used.discard(old.slot)
                dup_slots.append(old.slot)
            self._entries[rec.key] = DiskEntry(rec.key, slot, rec.length, rec.crc, rec.seq, rec.epoch, ready=True)
            self._lru[rec.key] = None
            used.add(slot)
        self._free = [s for s in range(self.num_slots - 1, -1, -1) if s not in used]
        return dup_slots


def slot_offset(slot: int, stride: int) -> int:
    return HEADER_BYTES + slot * stride


def record_offset(slot: int, stride: int, slot_bytes: int) -> int:
    return slot_offset(slot, stride) + align_up(slot_bytes)


def read_header(fd: int) -> Header:
    return unpack_header(os.pread(fd, HEADER_BYTES, 0))


def scan_records(fd: int, header: Header, num_slots: int | None = None) -> Iterator[tuple[int, Record | None, str]]:
    """(slot, record or None, status) for each slot of the file whose record block lies inside it. Status: "ok",
    "blank" (never written), "stale" (a valid record of an older epoch, i.e. written before a reset) or "corrupt"
    (a torn or damaged record block)."""
    size = os.fstat(fd).st_size
    n = header.num_slots if num_slots is None else min(num_slots, header.num_slots)
    for slot in range(n):
        off = record_offset(slot, header.stride, header.slot_bytes)
        if off + RECORD_BYTES > size:
            break
        raw = os.pread(fd, RECORD_BYTES, off)
        if is_blank(raw):
            yield slot, None, "blank"
            continue
        rec = unpack_record(raw)
        if rec is None or rec.length > header.slot_bytes:
            yield slot, None, "corrupt"
        elif rec.epoch != header.epoch:
            yield slot, None, "stale"
        else:
            yield slot, rec, "ok"


def scan_directory(directory: str, fingerprint: DiskFingerprint | None
                   ) -> tuple[Header, list[tuple[int, Record]], int]:
    """Read a disk tier's directory without opening it for writing (e.g. from the scheduler process): its header
    and the valid (slot, record) pairs, and how many records were corrupt. Raises `FingerprintMismatch` when it was
    written for something else (`fingerprint` None: accept the header as it is, e.g. after the worker that owns the
    directory has opened it, checked it against its own fingerprint and reset it if it did not match). Data CRCs are not checked here (that is a read of every byte); `DiskStore` checks
    each slot's data CRC when it reads it."""
    fd = os.open(os.path.join(directory, FILE_NAME), os.O_RDONLY)
    try:
        header = read_header(fd)
        if fingerprint is not None:
            check_fingerprint(header, fingerprint)
        found, corrupt = [], 0
        for slot, rec, status in scan_records(fd, header):
            if rec is not None:
                found.append((slot, rec))
            elif status == "corrupt":
                corrupt += 1
        return header, found, corrupt
    finally:
        os.close(fd)


def check_fingerprint(header: Header, fingerprint: DiskFingerprint) -> None:
    if header.fingerprint != fingerprint:
        diff = "; ".join(fingerprint.differences(header.fingerprint))
        raise FingerprintMismatch(f"disk tier was written for a different model, KV layout or vLLM release ({diff})")
