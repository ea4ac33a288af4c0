"""The cache-policy interface of the CPU tier: which idle entry `TierIndex` evicts when a store needs a slot.

The tier keeps the facts (which entries exist, which are readable, how many jobs pin each); a policy only keeps an
order. `TierIndex` calls a policy at these points, and only there:

* `stored(key)`: a new entry was created for a store (pinned, not readable yet, not evictable).
* `unshared(key)`: right after `stored(key)`, when the request storing it shared no prefix with anything cached (GPU
  prefix cache or any tier) when it arrived: one-shot traffic, or the first turn of a conversation. Optional (not in
  `offload_connector.policies.POLICY_METHODS`); `slru` weighs such entries by how often their requests come back.
* `release(key)`: the entry became evictable: readable and no job pins it (its store landed, or its last load did).
  A prefix is released tail first, so its head is the most recent.
* `pin(key)`: the entry stopped being evictable (a load pins it).
* `loaded(key)`: the entry served a load (called right after `pin` for a load).
* `touch(key)`: the entry was used again; only meaningful while it is evictable.
* `reoffered(key)`: a store offered a key the tier already holds, readable: a request computed that block again (or
  found it in vLLM's GPU prefix cache) without loading it. Once per request and block, a prefix tail first. vLLM's
  CPU offloading manager counts this as a reuse. `arc` counts it as a hit (as vLLM's ARC); `slru` moves the entry to
  the recent end of its segment without protecting it (or protects it, with `reuse_on_store`); `lru` ignores it, so
  that it keeps the tier's original behaviour.
* `removed(key)`: the entry left the tier other than as a victim: dropped (failed store or load) or cleared one by
  one. Not a cache decision, so no ghost of it is kept.
* `victim()`: pick one evictable entry, forget it (the tier evicts it) and return its key; None when none is
  evictable. It must return a key the policy was given by `release` and not taken back by `pin` / `removed`:
  `TierIndex` refuses anything else (a pinned or unreadable entry is never evicted, whatever the policy).
* `clear()`: a cache reset: every entry is gone.
* `is_evictable(key)`, `evictable_keys()` (eviction order, first victim first): for the invariant checks.

The built-in policies are in `lru.py`, `slru.py` and `arc.py`; `__init__.py` names them (the registry).
"""

from __future__ import annotations

from offload_connector.keys import BlockKey

Key = BlockKey

# Called by TierIndex; a class named by module path must have every one of them.


class EvictionPolicy:
    """Base class: the interface `TierIndex` calls (see the module docstring). `stored`, `loaded`, `touch`,
    `reoffered` and `removed` default to doing nothing beyond what `pin` implies; the rest must be implemented."""

    name = "custom"

    def __init__(self, capacity_slots: int) -> None:
        self.capacity_slots = capacity_slots

    def stored(self, key: Key) -> None:
        pass

    def unshared(self, key: Key) -> None:
        pass

    def release(self, key: Key) -> None:
        raise NotImplementedError

    def pin(self, key: Key) -> None:
        raise NotImplementedError

    def loaded(self, key: Key) -> None:
        pass

    def touch(self, key: Key) -> None:
        pass

    def reoffered(self, key: Key) -> None:
        pass

    def removed(self, key: Key) -> None:
        self.pin(key)

    def victim(self) -> Key | None:
        raise NotImplementedError

    def clear(self) -> None:
        raise NotImplementedError

    def is_evictable(self, key: Key) -> bool:
        raise NotImplementedError

    def evictable_keys(self) -> list[Key]:
        raise NotImplementedError

    def num_evictable(self) -> int:
        """How many entries are evictable now (a policy with its own containers answers without a list)."""
        return len(self.evictable_keys())
