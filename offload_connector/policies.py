"""The CPU tier's eviction policies, in one place: the config key `eviction` accepts these names (or a policy class
named by module path) and `scheduler/eviction` builds them from here.

Plain data and an importer, so the config parser checks a value without importing the scheduler side. A new built-in
policy is one module under `offload_connector/scheduler/eviction/` and one line below.
"""

from __future__ import annotations

import importlib
import inspect
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from offload_connector.scheduler.eviction.base import EvictionPolicy

# name -> (module under offload_connector.scheduler.eviction, class). The order is the one error messages list.
EVICTION_POLICIES: dict[str, tuple[str, str]] = {
    "lru": ("lru", "LRUPolicy"),
    "slru": ("slru", "SegmentedLRUPolicy"),
    "arc": ("arc", "ARCPolicy"),
}

# The methods a policy class must have (`scheduler/eviction/base.py` says when the tier calls each).
POLICY_METHODS = ("stored", "release", "pin", "loaded", "touch", "reoffered", "removed", "victim", "clear",
                  "is_evictable", "evictable_keys")


def builtin_policy(name: str) -> Callable[[int], EvictionPolicy]:
    module, cls = EVICTION_POLICIES[name]
    return getattr(importlib.import_module(f"offload_connector.scheduler.eviction.{module}"), cls)


def check_policy_spec(spec: object) -> str:
    """The `eviction` value if it names a usable policy; a one-line ValueError saying why not otherwise."""
    load_policy_factory(spec)
    return spec  # type: ignore[return-value]


def load_policy_factory(spec: object) -> Callable[[int], EvictionPolicy]:
    """A built-in name, or "module.path:ClassName" of a class with the interface of
    `scheduler/eviction/base.EvictionPolicy` (imported and checked)."""
    accepted = f"one of {list(EVICTION_POLICIES)} or \"module.path:ClassName\" of an eviction policy class"
    if not isinstance(spec, str):
        raise ValueError(f"must be {accepted}; got {spec!r}")
    if spec in EVICTION_POLICIES:
        return builtin_policy(spec)
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


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 200 else text[:197] + "..."
