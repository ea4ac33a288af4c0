"""The CPU tier's index: which (KV cache group, block hash) pairs the host tier holds, in which slot.

Keys are vLLM's own prefix block hashes (chained, so one hash names a whole prefix) paired with the KV cache group,
because groups hold different layers of the same tokens. Slots are uniform host pages of the largest per-block byte
size of any group (vLLM's GPU pool does the same: every group's block is one block id of one page size), so the
worker can address a slot as `slot * slot_bytes` without knowing the group.

Entries move through: stored (pinned, not yet readable) -> ready (readable, evictable when unpinned) -> evicted.
A load pins ready entries so eviction cannot reuse their slots while the copy runs. Which evictable entry goes first
is the cache policy's choice (`scheduler/eviction/`: "lru", "slru", "arc" or a class named by module path); the
index tells it when an entry is stored, becomes evictable, is pinned, serves a load, is touched, is offered again by
a store or is dropped, and refuses a victim that is not a readable, unpinned entry. `rank` reorders a finished
request's entries, regular and spare each among their kind (`scheduler/ranking.py` says in which order).

*Spare* entries are the ones a store marks so (windows of sliding-window and chunked-local groups at points no rule
asked for, `scheduler/stores.py`): they take only room nobody else uses. A spare entry gets a free slot or the slot
of another spare entry, never a regular entry's; when a regular store needs a slot, idle spare entries go first,
before the policy is asked; the policy never sees them. Among spare entries, those stored by requests that shared no
prefix when they arrived (one-shot prompts; until a request that did offers them again) go first, then the others,
each oldest first: a later request that branches inside a prompt mostly branches from one that was itself shared (a
system prompt, a document, a conversation), and one-shot traffic between a parent and its branches would otherwise
evict the parent's fresh windows with its own. A spare entry that serves a load, or that a regular store offers
again (`promote`), becomes a regular entry and the policy hears of it as newly stored. So a roomy tier holds every
window, as vLLM's connector stores every block, and a full one holds exactly what it held without them.

`clear()` (a cache reset) forgets every entry at once. An entry a copy still uses (pinned by an in-flight load, or
being written by an in-flight store) leaves the index but keeps its slot, "retired": no lookup finds it and no store
gets the slot until every job that used it calls `release_retired` with its slots. Until then a key can be stored
again in a fresh slot without touching the retired one.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Collection, Iterable, Mapping, Sequence

from offload_connector.scheduler.eviction import EvictionPolicy, make_policy
from offload_connector.keys import BlockKey

Key = BlockKey


@dataclass
class _Entry:
    slot: int
    nbytes: int
    ready: bool = False
    pins: int = 1  # created pinned by the store that fills it
    spare: bool = False
    oneshot: bool = False  # stored by a request that shared no prefix when it arrived


@dataclass(frozen=True)
class TierStats:
    capacity_slots: int
    used_slots: int
    used_bytes: int
    ready_entries: int
    pinned_entries: int
    evictions: int
    store_rejections: int
    spare_entries: int = 0
    spare_evictions: int = 0
    spare_skips: int = 0  # spare blocks not stored: no free or spare slot
    retired_slots: int = 0  # slots of entries a reset removed while a copy still used them


@dataclass(frozen=True)
class EntryView:
    slot: int
    nbytes: int
    ready: bool
    pins: int


@dataclass(frozen=True)
class TierView:
    """A read-only copy of the index, for invariant checks (`TierIndex.view()`)."""
    capacity_slots: int
    entries: Mapping[Key, EntryView]
    free_slots: tuple[int, ...]  # slots handed out once and free again
    retired: Mapping[int, int]  # slot -> jobs still using it (see `clear`)
    next_slot: int  # slots handed out so far; the rest were never used
    used_bytes: int


class TierIndex:
    def __init__(self, capacity_slots: int, group_block_bytes: Sequence[int],
                 policy: str | EvictionPolicy = "lru") -> None:
        if capacity_slots <= 0:
            raise ValueError("the CPU tier must hold at least one block")
        self.capacity_slots = capacity_slots
        self._group_bytes = list(group_block_bytes)
        self._entries: dict[Key, _Entry] = {}
        # Orders the ready, unpinned entries and picks victims among them (the `eviction` key).
        self.policy: EvictionPolicy = make_policy(policy, capacity_slots)
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._used_bytes = 0
        self.evictions = 0
        self.store_rejections = 0
        # Idle (readable, unpinned) spare entries, oldest first: the first victims, unknown to the policy.
        self._spare: OrderedDict[Key, None] = OrderedDict()
        self._spare_oneshot: OrderedDict[Key, None] = OrderedDict()  # of those, the ones of one-shot prompts
        self.spare_evictions = 0
        self.spare_skips = 0
        self._promoted_ready: list[Key] = []  # readable spare entries promoted since `take_promoted`
        # Slots of entries removed by `clear()` while in-flight jobs used them -> jobs still to release each slot.
        self._retired: dict[int, int] = {}
        # Called with each key whose readable entry leaves the tier (eviction, drop, clear): KV cache events.
        self.on_removed: Callable[[Key], None] | None = None

    # ----------------------------------------------------------------- queries
    def is_ready(self, key: Key) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.ready

    def has(self, key: Key) -> bool:
        return key in self._entries

    def slot_of(self, key: Key) -> int:
        return self._entries[key].slot

    def keys(self) -> Iterable[Key]:
        """The key of every entry, readable or still being stored (a live view; do not change the index while
        iterating)."""
        return self._entries.keys()

    def __len__(self) -> int:
        return len(self._entries)

    def used_slots(self) -> int:
        """Slots not free: the entries' and the retired ones still in use by a copy."""
        return len(self._entries) + len(self._retired)

    def stats(self) -> TierStats:
        return TierStats(
            capacity_slots=self.capacity_slots,
            used_slots=len(self._entries),
            used_bytes=self._used_bytes,
            ready_entries=sum(1 for e in self._entries.values() if e.ready),
            pinned_entries=sum(1 for e in self._entries.values() if e.pins > 0),
            evictions=self.evictions,
            store_rejections=self.store_rejections,
            spare_entries=sum(1 for e in self._entries.values() if e.spare),
            spare_evictions=self.spare_evictions,
            spare_skips=self.spare_skips,
            retired_slots=len(self._retired),
        )

    def view(self) -> TierView:
        """A copy of every entry and slot list (walks everything; not for the scheduler's own path)."""
        return TierView(self.capacity_slots,
                        MappingProxyType({k: EntryView(e.slot, e.nbytes, e.ready, e.pins)
                                          for k, e in self._entries.items()}),
                        tuple(self._free_slots), MappingProxyType(dict(self._retired)), self._next_slot,
                        self._used_bytes)

    def is_evictable(self, key: Key) -> bool:
        return key in self._spare or self.policy.is_evictable(key)

    def is_spare(self, key: Key) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.spare

    def evictable_keys(self) -> list[Key]:
        """The evictable entries in eviction order (first victim first): idle spare entries (one-shot prompts' first),
        then the policy's."""
        return [*self._spare_oneshot, *(k for k in self._spare if k not in self._spare_oneshot),
                *self.policy.evictable_keys()]

    def pin_count(self, key: Key) -> int:
        entry = self._entries.get(key)
        return 0 if entry is None else entry.pins

    # ----------------------------------------------------------------- stores
    def begin_store(self, keys: Iterable[Key], unshared: bool = False,
                    spare: Collection[Key] = ()) -> list[tuple[Key, int]]:
        """Reserve slots for new entries, evicting idle ready entries (spare ones first, then the policy's victims)
        as needed.

        `unshared`: the storing request shared no prefix with anything cached when it arrived; a policy with an
        `unshared(key)` method hears it for each new entry (`EvictionPolicy.unshared`). `spare`: the keys to store as
        spare entries (a free slot or another spare entry's, else skipped). Keys already present are skipped (a
        regular offer of a spare entry promotes it). Stops at the first regular key that cannot get a slot: the keys
        come in prefix order and a prefix with a hole in it is useless to a later request. Regular keys get their
        slots before any spare key of the same call (a spare key earlier in prefix order would otherwise take a free
        slot a regular key after it needs, and the regular key would be refused); spare keys past a refused regular
        key are skipped. Returns (key, slot) for each key reserved; those entries stay pinned and unreadable until
        `finish_store`.
        """
        keys = list(keys)
        reserved: list[tuple[Key, int]] = []
        again: list[Key] = []
        # Optional in a policy named by module path: one written before the hint existed has no such method.
        hint = getattr(self.policy, "unshared", None) if unshared else None
        stop = len(keys)
        for n, key in enumerate(keys):
            if key not in spare and not self._offer(key, False, unshared, hint, reserved, again):
                stop = n
                break
        for key in keys[:stop]:
            if key in spare:
                self._offer(key, True, unshared, hint, reserved, again)
        for key in reversed(again):  # tail first, like every other recency update
            self.policy.reoffered(key)
        return reserved

    def _offer(self, key: Key, is_spare: bool, unshared: bool, hint: Callable[[Key], None] | None,
               reserved: list[tuple[Key, int]], again: list[Key]) -> bool:
        """One key of `begin_store`; False when a regular key gets no slot."""
        entry = self._entries.get(key)
        if entry is not None:
            if not is_spare:
                if entry.spare:
                    self.promote([key])
                elif entry.ready:
                    again.append(key)
            elif key in self._spare:  # a spare offer says nothing to the policy
                self._renew_spare(key)
            if entry.spare and entry.oneshot and not unshared:  # a shared prompt's window now
                entry.oneshot = False
                self._spare_oneshot.pop(key, None)
            return True
        if is_spare:
            slot = self._free_slot()
            if slot is None and self._spare:
                slot = self._evict_spare()
            if slot is None:
                self.spare_skips += 1
                return True
        else:
            slot = self._take_slot()
            if slot is None:
                self.store_rejections += 1
                return False
        nbytes = self._group_bytes[key[0]]
        self._entries[key] = _Entry(slot=slot, nbytes=nbytes, spare=is_spare, oneshot=unshared)
        self._used_bytes += nbytes
        if not is_spare:
            self.policy.stored(key)
            if hint is not None:
                hint(key)
        reserved.append((key, slot))
        return True

    def promote(self, keys: Iterable[Key]) -> None:
        """Make spare entries regular (a load used one, or a store point that a rule asked for covers it): the
        policy hears of each as newly stored, and of it becoming evictable if it is idle. Other keys are ignored."""
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or not entry.spare:
                continue
            entry.spare = False
            self._unspare(key)
            self.policy.stored(key)
            if entry.ready:
                self._promoted_ready.append(key)
                if entry.pins == 0:
                    self.policy.release(key)

    def take_promoted(self) -> list[Key]:
        """The readable entries promoted since the last call: regular now, so the second tiers write them through
        (a spare entry is not written through; one still being stored is, when its store lands)."""
        out, self._promoted_ready = self._promoted_ready, []
        return [k for k in out if k in self._entries]

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
                self._release(key, entry)

    # ------------------------------------------------------------------ loads
    def pin(self, keys: Iterable[Key], served: bool = True) -> list[int]:
        """Pin readable entries against eviction and return their slots. `served`: for a load (the policy hears that
        they served one); False for a copy that only reads them (a disk tier write), which says nothing of reuse."""
        slots = []
        for key in keys:
            entry = self._entries[key]
            if not entry.ready:
                raise KeyError(f"tier entry {key!r} is not readable yet")
            entry.pins += 1
            if not entry.spare:
                self.policy.pin(key)
            else:
                self._unspare(key)
                if served:  # it served a load: a regular entry from now on (the policy hears it stored, pinned)
                    self.promote([key])
            if served and not entry.spare:
                self.policy.loaded(key)
            slots.append(entry.slot)
        return slots

    def has_room(self, n: int) -> bool:
        """Whether `begin_store` of `n` new keys would get a slot for each now (free slots and idle entries to
        evict)."""
        free = self.capacity_slots - self._next_slot + len(self._free_slots) + len(self._spare)
        return free >= n or free + self.policy.num_evictable() >= n

    def unpin(self, keys: Sequence[Key]) -> None:
        for key in reversed(keys):
            entry = self._entries.get(key)
            if entry is None:
                continue
            entry.pins -= 1
            assert entry.pins >= 0, key
            if entry.pins == 0 and entry.ready:
                self._release(key, entry)

    def touch(self, keys: Sequence[Key]) -> None:
        """Mark entries as recently used, the last key first, so that the first is the most recent (a prefix given
        head first: its head)."""
        for key in reversed(keys):
            entry = self._entries.get(key)
            if entry is None:
                continue
            if not entry.spare:
                self.policy.touch(key)
            elif key in self._spare:
                self._renew_spare(key)

    def rank(self, order: Iterable[Key]) -> None:
        """Reorder idle entries as the most recent of their kind: `order` first victim first, regular entries among
        the regular ones (as touches the policy hears), spare ones among the spare ones. Pinned or unknown keys are
        skipped."""
        self.touch(list(order)[::-1])

    def drop(self, keys: Iterable[Key]) -> None:
        """Forget the entries of a failed load. Entries another load still pins are kept: its copy is reading them,
        and a failure (a timeout, a copy error) does not show that the stored bytes are bad."""
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None and entry.pins == 0:
                self._drop(key)

    # ------------------------------------------------------------------ reset
    def clear(self) -> None:
        """Forget every entry (a cache reset). Idle entries free their slots now. An entry an in-flight job still
        uses, pinned by loads or being written by its store, is retired: it leaves the index (no lookup, eviction or
        `finish_store` / `unpin` / `drop` sees it again) but its slot stays taken until each of those jobs calls
        `release_retired` with its slots, so nothing is stored over a slot a copy still reads or writes."""
        for key, entry in self._entries.items():
            if entry.ready and self.on_removed is not None:
                self.on_removed(key)
            if entry.pins > 0:
                self._retired[entry.slot] = self._retired.get(entry.slot, 0) + entry.pins
            else:
                self._free_slots.append(entry.slot)
        self._entries.clear()
        self._spare.clear()
        self._spare_oneshot.clear()
        self._promoted_ready.clear()
        self.policy.clear()
        self._used_bytes = 0

    def retire(self, keys: Iterable[Key]) -> tuple[int, ...]:
        """Forget entries still being written (a failed load's read-back that has not returned): they leave the index
        at once, but their slots stay taken until `release_retired`, so nothing is stored over a slot a late read can
        still write. Returns the slots."""
        slots = []
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or entry.ready:
                continue
            self._drop(key, free_slot=False)
            self._retired[entry.slot] = self._retired.get(entry.slot, 0) + 1
            slots.append(entry.slot)
        return tuple(slots)

    def release_retired(self, slots: Iterable[int]) -> None:
        """A job issued before `clear()` finished (landed or failed): its retired slots lose one user each, and a
        slot no job uses any more is free again. Slots that were not retired are ignored."""
        for slot in slots:
            users = self._retired.get(slot)
            if users is None:
                continue
            if users > 1:
                self._retired[slot] = users - 1
            else:
                del self._retired[slot]
                self._free_slots.append(slot)

    # --------------------------------------------------------------- internal
    def _free_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        if self._next_slot < self.capacity_slots:
            self._next_slot += 1
            return self._next_slot - 1
        return None

    def _take_slot(self) -> int | None:
        slot = self._free_slot()
        if slot is not None:
            return slot
        if self._spare:
            return self._evict_spare()
        victim = self.policy.victim()
        if victim is None:
            return None
        entry = self._entries.get(victim)
        if entry is None or not entry.ready or entry.pins or entry.spare:
            raise RuntimeError(f"eviction policy {type(self.policy).__name__} chose {victim!r}, which is not a "
                               f"readable, unpinned tier entry ({entry})")
        self.evictions += 1
        del self._entries[victim]
        self._used_bytes -= entry.nbytes
        if self.on_removed is not None:
            self.on_removed(victim)
        return entry.slot

    def _evict_spare(self) -> int:
        key = next(iter(self._spare_oneshot or self._spare))
        self._unspare(key)
        entry = self._entries.pop(key)
        self.evictions += 1
        self.spare_evictions += 1
        self._used_bytes -= entry.nbytes
        if self.on_removed is not None:
            self.on_removed(key)
        return entry.slot

    def _release(self, key: Key, entry: _Entry) -> None:
        """An entry became idle (readable, unpinned): evictable, spare ones first."""
        if entry.spare:
            self._spare[key] = None
            self._spare.move_to_end(key)
            if entry.oneshot:
                self._spare_oneshot[key] = None
                self._spare_oneshot.move_to_end(key)
        else:
            self.policy.release(key)

    def _drop(self, key: Key, free_slot: bool = True) -> None:
        entry = self._entries.pop(key)
        if entry.spare:
            self._unspare(key)
        else:
            self.policy.removed(key)
        self._used_bytes -= entry.nbytes
        if free_slot:
            self._free_slots.append(entry.slot)
        if entry.ready and self.on_removed is not None:  # an unpublished entry was never announced
            self.on_removed(key)

    def _renew_spare(self, key: Key) -> None:
        """An idle spare entry was offered or touched again: the recent end of its list."""
        self._spare.move_to_end(key)
        if key in self._spare_oneshot:
            self._spare_oneshot.move_to_end(key)

    def _unspare(self, key: Key) -> None:
        self._spare.pop(key, None)
        self._spare_oneshot.pop(key, None)


# Any: the columns differ in type (groups, block ids, keys), and the callers unpack each back into its own.
def in_prefix_order(positions: list[int], *columns: list[Any]) -> list[list[Any]]:
    """Reorders parallel per-block lists by the token position just past each block, across groups.

    The tier ages a prefix from its tail in the order it is handed blocks, so in this order a window is evicted
    together with the full-attention blocks around its point, not before them (which left those full-attention
    blocks useless past the last window still stored)."""
    order = sorted(range(len(positions)), key=positions.__getitem__)
    return [[col[i] for i in order] for col in columns]
