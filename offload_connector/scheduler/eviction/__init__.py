"""Cache policies for the CPU tier: which idle entry `TierIndex` evicts when a store needs a slot.

The interface is `base.EvictionPolicy` (its module docstring says when `TierIndex` calls each method). Built in:
`"lru"` (least recently released or touched first), `"slru"` (segmented LRU: entries that served a load are evicted
after every entry that never did; that protected segment holds at most `protected_share` of the slots; probation
weighs the entries of requests that shared nothing against the rest by ghost hits) and `"arc"`
(Adaptive Replacement Cache adapted to the tier). Any other class is named by module path,
`"my_pkg.my_mod:MyPolicy"`, and constructed as `MyPolicy(capacity_slots)`; `check_policy_spec` imports and checks
it at start-up.

A new built-in policy is one module here and one line in `BUILTIN_POLICIES`.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Callable, Iterable

from offload_connector.scheduler.eviction.arc import ARCPolicy
from offload_connector.scheduler.eviction.base import POLICY_METHODS, EvictionPolicy, Key
from offload_connector.scheduler.eviction.lru import LRUPolicy
from offload_connector.scheduler.eviction.slru import SegmentedLRUPolicy

__all__ = ["ARCPolicy", "BUILTIN_POLICIES", "EvictionPolicy", "Key", "LRUPolicy", "POLICY_METHODS",
           "SegmentedLRUPolicy", "check_policy_spec", "load_policy_factory", "make_policy", "policy_names"]

# The order is the one error messages and `policy_names()` list.
BUILTIN_POLICIES: dict[str, Callable[[int], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "slru": SegmentedLRUPolicy,
    "arc": ARCPolicy,
}


def check_policy_spec(spec: object) -> str:
    """The `eviction` value if it names a usable policy; a one-line ValueError saying why not otherwise."""
    load_policy_factory(spec)
    return spec  # type: ignore[return-value]


def load_policy_factory(spec: object) -> Callable[[int], EvictionPolicy]:
    """A built-in name, or "module.path:ClassName" of a class with the interface of
    `base.EvictionPolicy` (imported and checked)."""
    accepted = f"one of {list(BUILTIN_POLICIES)} or \"module.path:ClassName\" of an eviction policy class"
    if not isinstance(spec, str):
        raise ValueError(f"must be {accepted}; got {spec!r}")
    if spec in BUILTIN_POLICIES:
        return BUILTIN_POLICIES[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr or not all(p.isidentifier() for p in module_name.split(".")) \
            or not all(p.isidentifier() for p in attr.split(".")):
        raise ValueError(f"must be {accepted}; got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's module's, reported in one line
        raise ValueError(f"must be {accepted}; got {spec!r} (cannot import {module_name!r}: "
                         f"{type(exc).__name__}: {_one_line(exc)})") from None
    obj: object = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"must be {accepted}; got {spec!r} (module {module_name!r} has no {attr!r})")
        obj = getattr(obj, part)
    if not inspect.isclass(obj):
        raise ValueError(f"must be {accepted}; got {spec!r} ({attr!r} is not a class)")
    missing = [m for m in POLICY_METHODS if not callable(getattr(obj, m, None))]
    if missing:
        raise ValueError(f"must be {accepted}; got {spec!r} ({attr!r} lacks the method(s) {missing})")
    try:
        inspect.signature(obj).bind(1)
    except TypeError:
        raise ValueError(f"must be {accepted}; got {spec!r} ({attr!r} cannot be constructed as "
                         f"{attr}(capacity_slots))") from None
    except ValueError:  # no signature to inspect (a builtin): let construction tell
        pass
    return obj  # type: ignore[return-value]


def make_policy(spec: str | EvictionPolicy, capacity_slots: int) -> EvictionPolicy:
    if not isinstance(spec, str):
        return spec
    return load_policy_factory(spec)(capacity_slots)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 200 else text[:197] + "..."


def policy_names() -> Iterable[str]:
    return tuple(BUILTIN_POLICIES)
