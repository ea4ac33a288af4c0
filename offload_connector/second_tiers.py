"""The second tiers (below the CPU tier), in one place: name -> its scheduler-side planner factory, its worker-side
client factory and its metrics (`metrics.TierMetrics`), in read order (the nearest first: a load's block is read
back from the first tier that holds it).

Plain data (no torch, no vLLM), like `backends.py`: the scheduler side resolves only the first factory, the worker side
only the second, so neither imports the other; the Prometheus side reads every tier's metrics. A factory takes its
side's context (`scheduler.second_tier.PlannerContext`, `worker.second_tier.ClientContext`) and returns the tier, or
None when the configuration does not turn it on. A new tier is one package with the two factories and its metrics,
and one line below.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Callable, cast

from offload_connector.transfer_jobs import DISK, SHARED

if TYPE_CHECKING:
    from offload_connector.metrics import TierMetrics

# name (its key in the step messages) -> ("module:factory" on the scheduler side, "module:factory" on the worker side,
# "module:TierMetrics")
SECOND_TIERS: dict[str, tuple[str, str, str]] = {
    DISK: ("offload_connector.scheduler.disk_tier:open_planner", "offload_connector.worker.disk_io:open_client",
           "offload_connector.disk.metrics:METRICS"),
    SHARED: ("offload_connector.scheduler.remote_tier:open_planner", "offload_connector.worker.remote_io:open_client",
             "offload_connector.remote.metrics:METRICS"),
}

SIDES = ("scheduler", "worker")


def tier_factory(name: str, side: str) -> Callable[..., object]:
    """The registered factory of tier `name` on `side` ("scheduler" or "worker"), imported on demand."""
    if name not in SECOND_TIERS:
        raise ValueError(f"second tier {name!r} is not one of {tuple(SECOND_TIERS)}")
    if side not in SIDES:
        raise ValueError(f"side {side!r} is not one of {SIDES}")
    return cast("Callable[..., object]", _resolve(SECOND_TIERS[name][SIDES.index(side)]))


def tier_metrics(name: str) -> TierMetrics:
    """The metrics tier `name` declared (plain data; importing them needs neither side of the connector)."""
    if name not in SECOND_TIERS:
        raise ValueError(f"second tier {name!r} is not one of {tuple(SECOND_TIERS)}")
    return cast("TierMetrics", _resolve(SECOND_TIERS[name][2]))


def _resolve(target: str) -> object:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)
