from offload_connector.scheduler.eviction.slru import SegmentedLRUPolicy


class P10(SegmentedLRUPolicy):
    def __init__(self, cap):
        super().__init__(cap, protected_share=0.1)


class P20(SegmentedLRUPolicy):
    def __init__(self, cap):
        super().__init__(cap, protected_share=0.2)


class Aging(SegmentedLRUPolicy):
    """Protected entries unused for one tier turnover (capacity_slots probation releases/evictions) go first."""

    def __init__(self, cap):
        super().__init__(cap)
        self._pstamp = {}
        self._evictions = 0

    def _now(self):
        return self._clock + self._evictions

    def release(self, key):
        if key in self._served:
            self._pstamp[key] = self._now()
        super().release(key)

    def touch(self, key):
        if key in self._protected:
            self._pstamp[key] = self._now()
        super().touch(key)

    def victim(self):
        if self._protected:
            old = next(iter(self._protected))
            if self._now() - self._pstamp.get(old, 0) > self.capacity_slots:
                del self._protected[old]
                self._pstamp.pop(old, None)
                self._served.discard(old)
                self._unshared.discard(old)
                self._evictions += 1
                return old
        key = super().victim()
        if key is not None:
            self._evictions += 1
            self._pstamp.pop(key, None)
        return key

    def pin(self, key):
        super().pin(key)

    def removed(self, key):
        super().removed(key)
        self._pstamp.pop(key, None)

    def clear(self):
        super().clear()
        self._pstamp.clear()


class NoLapse(SegmentedLRUPolicy):
    def __init__(self, cap):
        super().__init__(cap, protected_expiry=None)


class Once(SegmentedLRUPolicy):
    """Lapse evicts a once-served protected head; a lapsed head served twice or more drops to probation instead."""

    def __init__(self, cap):
        super().__init__(cap, protected_expiry=1.0)
        self._multi = set()

    def loaded(self, key):
        if key in self._served:
            self._multi.add(key)
        super().loaded(key)

    def victim(self):
        while self._protected:
            k, used = next(iter(self._protected.items()))
            if not self._lapsed(used) or k not in self._multi:
                break
            del self._protected[k]
            self._multi.discard(k)
            self._to_probation(k)
        key = super().victim()
        self._multi.discard(key)
        return key

    def removed(self, key):
        super().removed(key)
        self._multi.discard(key)


from collections import OrderedDict


class AdaptCap(SegmentedLRUPolicy):
    """ARC-like: the protected cap shrinks by one slot per probation ghost hit, grows by one per served ghost hit."""

    def __init__(self, cap):
        super().__init__(cap, protected_expiry=None)
        self._sghosts = OrderedDict()
        self.max_cap = max(1, int(cap * 0.3))

    def stored(self, key):
        if key in self._sghosts:
            del self._sghosts[key]
            self.protected_cap = min(self.max_cap, self.protected_cap + 1)
        elif key in self._ghosts[False] or key in self._ghosts[True]:
            self.protected_cap = max(1, self.protected_cap - 1)
            while len(self._protected) > self.protected_cap:
                old, _ = self._protected.popitem(last=False)
                self._to_probation(old)
        super().stored(key)

    def victim(self):
        cls = self._victim_class()
        peek = next(iter(self._probation[cls])) if cls is not None else next(iter(self._protected), None)
        was_served = peek is not None and peek in self._served
        key = super().victim()
        if key is not None and key == peek and was_served:
            self._sghosts[key] = None
            if len(self._sghosts) > self.capacity_slots:
                self._sghosts.popitem(last=False)
        return key


class E2(SegmentedLRUPolicy):
    def __init__(self, cap):
        super().__init__(cap, protected_expiry=2.0)


class E4(SegmentedLRUPolicy):
    def __init__(self, cap):
        super().__init__(cap, protected_expiry=4.0)


class S1(SegmentedLRUPolicy):
    """Lapse after capacity_slots new entries were stored since the last use (a literal tier turnover)."""

    def __init__(self, cap, expiry=1.0):
        super().__init__(cap, protected_expiry=expiry)

    def stored(self, key):
        super().stored(key)
        self._uses += 1

    def release(self, key):
        self._uses -= 1
        super().release(key)

    def touch(self, key):
        self._uses -= 1
        super().touch(key)


class S2(S1):
    def __init__(self, cap):
        super().__init__(cap, 2.0)


class Adapt(SegmentedLRUPolicy):
    """Fixed-expiry lapse plus adaptation: a lapsed entry stored again lengthens the expiry by one use, a regular
    probation entry stored again shortens it (not below one turnover)."""

    def __init__(self, cap, step=1):
        super().__init__(cap, protected_expiry=1.0)
        self._min_uses = self._expiry_uses
        self._lghosts = OrderedDict()
        self._step = step

    def stored(self, key):
        if key in self._lghosts:
            del self._lghosts[key]
            self._expiry_uses += self._step
        elif key in self._ghosts[False] or key in self._ghosts[True]:
            self._expiry_uses = max(self._min_uses, self._expiry_uses - self._step)
        super().stored(key)

    def victim(self):
        cls = self._victim_class()
        from_lapsed = cls is False and self._shared_head_list() is self._lapsed
        key = super().victim()
        if from_lapsed and key is not None:
            self._ghosts[False].pop(key, None)
            self._lghosts[key] = None
            if len(self._lghosts) > self.capacity_slots:
                self._lghosts.popitem(last=False)
        return key


class Adapt8(Adapt):
    def __init__(self, cap):
        super().__init__(cap, step=8)


class E1000(SegmentedLRUPolicy):
    def __init__(self, cap):
        super().__init__(cap, protected_expiry=1000.0)


import atexit, json as _json, os as _os


class Inst(SegmentedLRUPolicy):
    """Counts lapses, evictions of lapsed entries, and later stores of evicted keys by where they were evicted from."""
    _all = []

    def __init__(self, cap):
        super().__init__(cap, protected_expiry=float(_os.environ.get("S24_EXPIRY", "1.0")))
        self.st = {"cap": cap, "lapses": 0, "evict_lapsed": 0, "evict_prob": 0, "evict_prot": 0,
                   "back_lapsed": 0, "back_prob": 0, "back_prot": 0, "relapse_served": 0}
        self._ev = {}
        Inst._all.append(self)

    def _expire(self):
        n = len(self._lapsed)
        super()._expire()
        self.st["lapses"] += len(self._lapsed) - n

    def stored(self, key):
        w = self._ev.pop(key, None)
        if w:
            self.st["back_" + w] += 1
        super().stored(key)

    def loaded(self, key):
        if key in self._lapsed:
            self.st["relapse_served"] += 1
        super().loaded(key)

    def victim(self):
        cls = self._victim_class()
        w = "prot" if cls is None else ("lapsed" if cls is False and self._shared_head_list() is self._lapsed else "prob")
        key = super().victim()
        if key is not None:
            self.st["evict_" + w] += 1
            self._ev[key] = w
        return key


@atexit.register
def _dump():
    p = _os.environ.get("S24_INST")
    if p and Inst._all:
        with open(p, "a") as f:
            for i in Inst._all:
                f.write(_json.dumps(i.st) + "\n")
