"""`"lru"`: the tier's original policy."""

from __future__ import annotations

from collections import OrderedDict

from offload_connector.scheduler.eviction.base import EvictionPolicy, Key


class LRUPolicy(EvictionPolicy):
    """Least recently used: entries are evicted in the order they became evictable, a touch moving one to the end."""

    name = "lru"

    def __init__(self, capacity_slots: int) -> None:
        super().__init__(capacity_slots)
        self._order: OrderedDict[Key, None] = OrderedDict()  # evictable, oldest first

    def release(self, key: Key) -> None:
        self._order[key] = None

    def pin(self, key: Key) -> None:
        self._order.pop(key, None)

    def touch(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def removed(self, key: Key) -> None:
        self._order.pop(key, None)

    def victim(self) -> Key | None:
        if not self._order:
            return None
        return self._order.popitem(last=False)[0]

    def clear(self) -> None:
        self._order.clear()

    def is_evictable(self, key: Key) -> bool:
        return key in self._order

    def evictable_keys(self) -> list[Key]:
        return list(self._order)

    def num_evictable(self) -> int:
        return len(self._order)
