"""`"slru"`: segmented LRU, entries that served a load outlive one-shot traffic; probation adapts between the
entries of requests that shared a prefix and those of requests that shared none."""

from __future__ import annotations

import math
from collections import OrderedDict

from offload_connector.scheduler.eviction.base import EvictionPolicy, Key


class SegmentedLRUPolicy(EvictionPolicy):
    """Segmented LRU: entries that have served a load are evicted only after every entry that never has, so one-shot
    traffic (filler, prompts nobody returns to) cannot push out prefixes that are being reused. The protected segment
    holds at most `protected_share` of the tier's slots (at least one); its oldest entries drop back to probation
    (at probation's most recent end) and return to the protected segment the next time a load releases them.

    A re-offered entry (a later request computed the block again, or found it in vLLM's GPU prefix cache, and its
    store offered it) moves to the recent end of its segment (`touch_on_reoffer`), as a touch does: it is in use
    again, in a window or prefix a request has just passed through. It is not protected, which only a load earns
    (`reuse_on_store` protects it instead). Measured on the nine "Load what fits" rows against ignoring re-offers:
    recompute 0.69x instead of 0.77x the patched vLLM's on rag-shared-docs (Gemma), 0.81x instead of 0.87x on
    agent-tool-prefix (Gemma) with TTFT p95 0.53x instead of 0.75x (p50 0.90x instead of 0.82x), 0.33x instead of
    0.38x on rag-shared-docs (gpt-oss); every other figure equal.

    Probation is two LRU lists: entries stored by a request that shared no prefix with anything cached when it
    arrived (`unshared`: one-shot filler, or the first turn of a conversation without a common prefix) and all
    others. An entry is evicted when its age (probation releases and touches since its own last one) weighted
    by its class is the largest: `exp(+bias/2)` for unshared entries, `exp(-bias/2)` for the others. The bias starts
    at 0, which is one LRU over probation, and moves by the evidence of ghosts, the keys of entries evicted from
    probation (at most `capacity_slots` per class): a store of a key that was evicted as unshared (its request came
    back) lowers it by `ghost_step`, one evicted as shared raises it, within +-`max_bias`. So where one-shot prompts
    never return (the RAG filler between a query and its follow-up), their entries go first and the follow-ups'
    short tails survive; where sessions that shared nothing come back, it falls instead. On gemma4-31b-returning,
    where the earlier static rules broke (a second pass for shared entries, or unshared entries always first: 22x and
    39x the patched vLLM's recompute), no evicted entry is ever stored again and the bias stays 0. `adaptive=False`
    keeps one LRU over probation.
    """

    name = "slru"

    def __init__(self, capacity_slots: int, protected_share: float = 0.3, reuse_on_store: bool = False,
                 touch_on_reoffer: bool = True, adaptive: bool = True, ghost_step: float | None = None,
                 max_bias: float = math.log(4096)) -> None:
        super().__init__(capacity_slots)
        if not 0.0 < protected_share <= 1.0:
            raise ValueError(f"protected_share must be in (0, 1]; got {protected_share!r}")
        if max_bias < 0:
            raise ValueError(f"max_bias must be >= 0; got {max_bias!r}")
        self.protected_share = protected_share
        self.reuse_on_store = reuse_on_store  # a re-offered entry counts as having served a load
        self.touch_on_reoffer = touch_on_reoffer  # a re-offered entry moves to the recent end of its segment
        self.protected_cap = max(1, int(capacity_slots * protected_share))
        self.adaptive = adaptive
        # Half a tier's worth of ghost hits of one class takes the bias from 0 to its bound: the evidence builds up
        # within one turnover of the tier, before the follow-ups it is meant to keep come back. A quarter of this
        # step (4 / capacity) was measured too slow: rag-shared-docs (Gemma) seed 3 still lost its last follow-up.
        self.ghost_step = 16.0 / capacity_slots if ghost_step is None else ghost_step
        self.max_bias = max_bias
        self.bias = 0.0
        self._clock = 0
        # Probation per class (True: unshared), least recent first; the value is the clock when it was last used.
        self._probation: dict[bool, OrderedDict[Key, int]] = {False: OrderedDict(), True: OrderedDict()}
        self._protected: OrderedDict[Key, None] = OrderedDict()
        self._served: set[Key] = set()  # entries in the tier that have served a load
        self._unshared: set[Key] = set()  # entries in the tier stored by a request that shared nothing
        self._ghosts: dict[bool, OrderedDict[Key, None]] = {False: OrderedDict(), True: OrderedDict()}

    def stored(self, key: Key) -> None:
        if not self.adaptive:
            return
        for cls, sign in ((True, -1.0), (False, 1.0)):
            ghosts = self._ghosts[cls]
            if key in ghosts:
                del ghosts[key]
                self.bias = max(-self.max_bias, min(self.max_bias, self.bias + sign * self.ghost_step))
                return

    def unshared(self, key: Key) -> None:
        if key not in self._served:
            self._unshared.add(key)

    def release(self, key: Key) -> None:
        if key not in self._served:
            self._to_probation(key)
            return
        self._protected[key] = None
        while len(self._protected) > self.protected_cap:
            old, _ = self._protected.popitem(last=False)
            self._to_probation(old)

    def pin(self, key: Key) -> None:
        self._probation[key in self._unshared].pop(key, None)
        self._protected.pop(key, None)

    def loaded(self, key: Key) -> None:
        self._served.add(key)
        self._unshared.discard(key)

    def touch(self, key: Key) -> None:
        segment = self._probation[key in self._unshared]
        if key in self._protected:
            self._protected.move_to_end(key)
        elif key in segment:
            del segment[key]
            self._to_probation(key)

    def reoffered(self, key: Key) -> None:
        # Another request computed or found this block: whoever stored it, it is shared now.
        if key in self._unshared:
            self._unshared.discard(key)
            if key in self._probation[True]:
                del self._probation[True][key]
                self._to_probation(key)
        if not self.reuse_on_store:
            if self.touch_on_reoffer:
                self.touch(key)
            return
        self._served.add(key)
        if self.is_evictable(key):
            self.pin(key)
            self.release(key)

    def removed(self, key: Key) -> None:
        self.pin(key)
        self._served.discard(key)
        self._unshared.discard(key)

    def victim(self) -> Key | None:
        cls = self._victim_class()
        if cls is not None:
            key = self._probation[cls].popitem(last=False)[0]
            if self.adaptive:
                ghosts = self._ghosts[cls]
                ghosts[key] = None
                if len(ghosts) > self.capacity_slots:
                    ghosts.popitem(last=False)
        elif self._protected:
            key = self._protected.popitem(last=False)[0]
        else:
            return None
        self._served.discard(key)
        self._unshared.discard(key)
        return key

    def clear(self) -> None:
        for d in (*self._probation.values(), *self._ghosts.values()):
            d.clear()
        self._protected.clear()
        self._served.clear()
        self._unshared.clear()

    def is_evictable(self, key: Key) -> bool:
        return key in self._probation[key in self._unshared] or key in self._protected

    def evictable_keys(self) -> list[Key]:
        """Probation in victim order (its two lists merged by weighted age), then the protected segment oldest
        first: the order in which victims are taken while no entry is released or touched (one store's victims);
        a release in between ages every entry and, with a bias, can reorder the two classes."""
        shared, unshared = list(self._probation[False].items()), list(self._probation[True].items())
        out: list[Key] = []
        i = j = 0
        while i < len(shared) or j < len(unshared):
            if j < len(unshared) and (i >= len(shared) or self._takes_unshared(shared[i][1], unshared[j][1])):
                out.append(unshared[j][0])
                j += 1
            else:
                out.append(shared[i][0])
                i += 1
        return [*out, *self._protected]

    def num_evictable(self) -> int:
        return len(self._probation[False]) + len(self._probation[True]) + len(self._protected)

    # -------------------------------------------------------------- internal
    def _to_probation(self, key: Key) -> None:
        self._clock += 1
        self._probation[key in self._unshared][key] = self._clock

    def _victim_class(self) -> bool | None:
        shared, unshared = self._probation[False], self._probation[True]
        if not shared or not unshared:
            return True if unshared else False if shared else None
        return self._takes_unshared(next(iter(shared.values())), next(iter(unshared.values())))

    def _takes_unshared(self, shared_stamp: int, unshared_stamp: int) -> bool:
        """Whether the unshared entry last used at `unshared_stamp` goes before the shared one at `shared_stamp`."""
        if self.bias == 0.0:
            return unshared_stamp < shared_stamp
        now = self._clock + 1
        return (now - unshared_stamp) * math.exp(self.bias) >= (now - shared_stamp)
