"""Cache policies for the CPU tier: which idle entry `TierIndex` evicts when a store needs a slot.

The interface is `base.EvictionPolicy` (its module docstring says when `TierIndex` calls each method). Built in:
`"lru"` (least recently released or touched first), `"slru"` (segmented LRU: entries that served a load are evicted
after every entry that never did; that protected segment holds at most `protected_share` of the slots; probation
weighs the entries of requests that shared nothing against the rest by ghost hits) and `"arc"`
(Adaptive Replacement Cache adapted to the tier). Any other class is named by module path,
`"my_pkg.my_mod:MyPolicy"`, and constructed as `MyPolicy(capacity_slots)`; `check_policy_spec` imports and checks
it at start-up.

A new built-in policy is one module here and one line in `offload_connector/policies.py`.
"""

from __future__ import annotations

from typing import Callable, Iterable

from offload_connector.policies import EVICTION_POLICIES, POLICY_METHODS, builtin_policy, check_policy_spec, \
    load_policy_factory
from offload_connector.scheduler.eviction.arc import ARCPolicy
from offload_connector.scheduler.eviction.base import EvictionPolicy, Key
from offload_connector.scheduler.eviction.lru import LRUPolicy
from offload_connector.scheduler.eviction.slru import SegmentedLRUPolicy

__all__ = ["ARCPolicy", "BUILTIN_POLICIES", "EvictionPolicy", "Key", "LRUPolicy", "POLICY_METHODS",
           "SegmentedLRUPolicy", "check_policy_spec", "load_policy_factory", "make_policy", "policy_names"]

# Built from the one registry, `offload_connector.policies.EVICTION_POLICIES`, in its order.
BUILTIN_POLICIES: dict[str, Callable[[int], EvictionPolicy]] = {name: builtin_policy(name) for name in EVICTION_POLICIES}


def make_policy(spec: str | EvictionPolicy, capacity_slots: int) -> EvictionPolicy:
    if not isinstance(spec, str):
        return spec
    return load_policy_factory(spec)(capacity_slots)


def policy_names() -> Iterable[str]:
    return tuple(BUILTIN_POLICIES)
