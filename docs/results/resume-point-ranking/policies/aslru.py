"""Experiment: slru whose protected cap adapts as ARC's target does (outside the repo until measured)."""
from collections import OrderedDict
from offload_connector.scheduler.eviction.slru import SegmentedLRUPolicy


class AdaptiveSLRU(SegmentedLRUPolicy):
    def __init__(self, capacity_slots: int) -> None:
        super().__init__(capacity_slots)
        self.protected_max = self.protected_cap
        # Keys evicted (True: had served a load; False: never had), most recent last.
        self._pg = {True: OrderedDict(), False: OrderedDict()}

    def stored(self, key):
        for served, sign in ((True, 1), (False, -1)):
            g = self._pg[served]
            if key in g:
                del g[key]
                other = len(self._pg[not served])
                step = max(1, other // max(1, len(g) + 1))
                self.protected_cap = max(1, min(self.protected_max, self.protected_cap + sign * step))
                while len(self._protected) > self.protected_cap:
                    old, _ = self._protected.popitem(last=False)
                    self._to_probation(old)
                break
        super().stored(key)

    def victim(self):
        cls = self._victim_class()
        if cls is not None:
            cand = next(iter(self._probation[cls]))
        elif self._protected:
            cand = next(iter(self._protected))
        else:
            return None
        served = cand in self._served
        key = super().victim()
        assert key == cand
        g = self._pg[served]
        g[key] = None
        if len(g) > self.capacity_slots:
            g.popitem(last=False)
        return key

    def clear(self):
        super().clear()
        for g in self._pg.values():
            g.clear()
