"""Experiment: slru protecting an entry only from its second load (outside the repo until measured)."""
from offload_connector.scheduler.eviction.slru import SegmentedLRUPolicy


class SLRU2(SegmentedLRUPolicy):
    def __init__(self, capacity_slots: int) -> None:
        super().__init__(capacity_slots)
        self._loads: dict = {}

    def loaded(self, key):
        n = self._loads.get(key, 0) + 1
        self._loads[key] = n
        if n >= 2:
            super().loaded(key)

    def removed(self, key):
        self._loads.pop(key, None)
        super().removed(key)

    def victim(self):
        key = super().victim()
        if key is not None:
            self._loads.pop(key, None)
        return key

    def clear(self):
        super().clear()
        self._loads.clear()
