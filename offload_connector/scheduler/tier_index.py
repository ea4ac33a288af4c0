"""The CPU tier's index: which (KV cache group, block hash) pairs the host tier holds, in which slot.

Keys are vLLM's own prefix block hashes (chained, so one hash names a whole prefix) paired with the KV cache group,
because groups hold different layers of the same tokens. Slots are uniform host pages of the largest per-block byte
size of any group (vLLM's GPU pool does the same: every group's block is one block id of one page size), so the
worker can address a slot as `slot * slot_bytes` without knowing the group.

Entries move through: stored (pinned, not yet readable) -> ready (readable, evictable when unpinned) -> evicted.
A load pins ready entries so eviction cannot reuse their slots while the copy runs.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Iterable, Sequence

Key = tuple[int, Hashable]  # (group index, vLLM block hash)


@dataclass
class _Entry:
    slot: int
    nbytes: int
    ready: bool = False
    pins: int = 1  # created pinned by the store that fills it


@dataclass(frozen=True)
class TierStats:
    capacity_slots: int
    used_slots: int
    used_bytes: int
    ready_entries: int
    pinned_entries: int
    evictions: int
    store_rejections: int


class TierIndex:
    def __init__(self, capacity_slots: int, group_block_bytes: Sequence[int]) -> None:
        if capacity_slots <= 0:
            raise ValueError("the CPU tier must hold at least one block")
        self.capacity_slots = capacity_slots
        self._group_bytes = list(group_block_bytes)
        self._entries: dict[Key, _Entry] = {}
        # Ready, unpinned entries in eviction order (oldest first).
        self._evictable: OrderedDict[Key, None] = OrderedDict()
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._used_bytes = 0
        self.evictions = 0
        self.store_rejections = 0

    # ----------------------------------------------------------------- queries
    def is_ready(self, key: Key) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.ready

    def has(self, key: Key) -> bool:
        return key in self._entries

    def slot_of(self, key: Key) -> int:
        return self._entries[key].slot

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> TierStats:
        return TierStats(
            capacity_slots=self.capacity_slots,
            used_slots=len(self._entries),
            used_bytes=self._used_bytes,
            ready_entries=sum(1 for e in self._entries.values() if e.ready),
            pinned_entries=sum(1 for e in self._entries.values() if e.pins > 0),
            evictions=self.evictions,
            store_rejections=self.store_rejections,
        )

    def pin_count(self, key: Key) -> int:
        entry = self._entries.get(key)
        return 0 if entry is None else entry.pins

    # ----------------------------------------------------------------- stores
    def begin_store(self, keys: Iterable[Key]) -> list[tuple[Key, int]]:
        """Reserve slots for new entries, evicting idle ready entries (least recently used first) as needed.

        Keys already present are skipped. Stops at the first key that cannot get a slot: the keys come in prefix
        order and a prefix with a hole in it is useless to a later request. Returns (key, slot) for each key
        reserved; those entries stay pinned and unreadable until `finish_store`.
        """
        reserved: list[tuple[Key, int]] = []
        for key in keys:
            if key in self._entries:
                continue
            slot = self._take_slot()
            if slot is None:
                self.store_rejections += 1
                break
            nbytes = self._group_bytes[key[0]]
            self._entries[key] = _Entry(slot=slot, nbytes=nbytes)
            self._used_bytes += nbytes
            reserved.append((key, slot))
        return reserved

    def finish_store(self, keys: Sequence[Key], ok: bool = True) -> None:
        """Publish stored entries (or drop them if the copy failed). The tail of a prefix becomes evictable before
        its head, so that eviction shortens prefixes instead of punching holes in them."""
        for key in reversed(keys):
            entry = self._entries.get(key)
            if entry is None or entry.ready:
                continue
            if not ok:
                self._drop(key)
                continue
            entry.ready = True
            entry.pins -= 1
            if entry.pins == 0:
                self._evictable[key] = None

    # ------------------------------------------------------------------ loads
    def pin(self, keys: Iterable[Key]) -> list[int]:
        slots = []
        for key in keys:
            entry = self._entries[key]
            if not entry.ready:
                raise KeyError(f"tier entry {key!r} is not readable yet")
            entry.pins += 1
            self._evictable.pop(key, None)
            slots.append(entry.slot)
        return slots

    def unpin(self, keys: Sequence[Key]) -> None:
        for key in reversed(keys):
            entry = self._entries.get(key)
            if entry is None:
                continue
            entry.pins -= 1
            assert entry.pins >= 0, key
            if entry.pins == 0 and entry.ready:
                self._evictable[key] = None

    def touch(self, keys: Sequence[Key]) -> None:
        """Mark a prefix as recently used, tail first so that its head is the most recent."""
        for key in reversed(keys):
            if key in self._evictable:
                self._evictable.move_to_end(key)

    def drop(self, keys: Iterable[Key]) -> None:
        """Forget entries whose contents are known bad (a failed load); pinned entries go when unpinned."""
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None and entry.pins == 0:
                self._drop(key)

    # --------------------------------------------------------------- internal
    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        if self._next_slot < self.capacity_slots:
            self._next_slot += 1
            return self._next_slot - 1
        if not self._evictable:
            return None
        victim, _ = self._evictable.popitem(last=False)
        self.evictions += 1
        entry = self._entries.pop(victim)
        self._used_bytes -= entry.nbytes
        return entry.slot

    def _drop(self, key: Key) -> None:
        entry = self._entries.pop(key)
        self._evictable.pop(key, None)
        self._used_bytes -= entry.nbytes
        self._free_slots.append(entry.slot)
