"""Fair admission: a deferred load keeps its room against requests that arrived after it.

A deferred load answers `None` to vLLM, which then skips it and goes on down its waiting queue. Without a rule, the
newer requests behind it take every block that frees up and the load waits until it ages out and its prefix is
recomputed. With `admission_policy: "fair"` the connector remembers every deferred load with the room it needs and,
when vLLM asks about a request that arrived later (in vLLM's own queue order: arrival, or priority then arrival),
holds that request back (`None`) unless it fits next to the oldest deferred load's need. vLLM 0.34's
`--cache-aware-admission-window` reorders the head of the waiting queue by GPU-cached tokens; the fair queue keeps
arrival order, so a request vLLM moved ahead of a deferred load is still held for it (docs/results, "vLLM 0.34").

Holding every newer request from the first deferred step makes short requests wait for as long as the load waits,
and a load that waits for long decoders (older than it) to finish is admitted no sooner for it. So a deferred load
holds newer requests back only while it is waiting for *them*: while the blocks held by requests behind it in the
queue, given back, would let it in. Then no newer request starts (they finish and give their blocks back, and the
load goes in); otherwise newer requests run as if nothing waited, and the load is admitted when its older blockers
finish or, should that moment find newer requests in its way, after those few finish. Once a load has waited
`fair_hold_after_steps` steps it holds every newer request back regardless (the bound of the old rule), save the
ones below.

A newer request whose prompt starts with the whole prefix the deferred load is to load is never held for it: the
two do not compete for that prefix. Whichever goes first brings it into vLLM's GPU cache, and the other finds it
there (the deferred load shrinks to its own tail), so holding it would only reorder the two. Held, they waited
for the older sibling's load (vLLM 0.34's decode-heavy at 16-token blocks: third-wave siblings held 46 steps
behind an older sibling's deferred load, TTFT p95 1.06x the patched vLLM). Requests that share less (a system
prompt or tool definitions in front of a longer loaded context) are held as before. This holds after
`fair_hold_after_steps` too, and cannot starve the load: while such a request runs, the prefix is in vLLM's GPU
cache, so the older request needs no load (or only what the cache lacks, e.g. a Mamba state between its
checkpoints) and vLLM's own queue order puts it before the newer ones.

Why this cannot stall: only requests *behind* a deferred load are held, and the deferred load waits only for blocks
held by requests that are already running or already admitted (they finish and give them back); a load that could
not fit even in an idle pool is never deferred (it is recomputed at once). Requests ahead of it are never held, so a
preempted older request can always come back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Hashable

if TYPE_CHECKING:
    from vllm.v1.request import Request


@dataclass(frozen=True)
class DeferredLoad:
    request_id: str
    order: tuple[float, ...]  # vLLM's queue order: smaller goes first
    since: int  # scheduler step of its first deferral
    now: int  # blocks (all groups) its load takes from the free pool when admitted
    total: int  # now + what it may still take through its prompt
    prefix_blocks: int = 0  # hash blocks through the end of the prefix it loads
    prefix_hash: Hashable | None = None  # vLLM's (chained) hash of the last of them: the whole prefix's identity


class FairQueue:
    def __init__(self, priority_policy: bool, grace_steps: int = 0) -> None:
        self._priority = priority_policy
        self._grace = grace_steps
        self._deferred: dict[str, DeferredLoad] = {}

    def order(self, request: Request) -> tuple[float, ...]:
        arrival = float(getattr(request, "arrival_time", 0.0) or 0.0)
        if self._priority:
            return (float(getattr(request, "priority", 0) or 0), arrival)
        return (arrival,)

    def defer(self, request: Request, step: int, now: int, total: int, prefix_blocks: int = 0) -> None:
        """Remember `request`'s deferred load: `now` and `total` blocks, loading its first `prefix_blocks` hash
        blocks."""
        old = self._deferred.get(request.request_id)
        since = step if old is None else old.since
        hashes = getattr(request, "block_hashes", ())
        prefix_hash = hashes[prefix_blocks - 1] if 0 < prefix_blocks <= len(hashes) else None
        self._deferred[request.request_id] = DeferredLoad(request.request_id, self.order(request), since, now, total,
                                                          prefix_blocks if prefix_hash is not None else 0, prefix_hash)

    def clear(self, request_id: str) -> None:
        self._deferred.pop(request_id, None)

    def oldest_ahead_of(self, request: Request) -> DeferredLoad | None:
        """The deferred load that vLLM's queue puts first, if it is ahead of `request`."""
        if not self._deferred:
            return None
        me = self.order(request)
        ahead = [d for d in self._deferred.values() if d.request_id != request.request_id and d.order < me]
        return min(ahead, key=lambda d: d.order) if ahead else None

    @staticmethod
    def shares_prefix(load: DeferredLoad, request: Request) -> bool:
        """Whether `request`'s prompt starts with the whole prefix `load` is to load (see the module docstring)."""
        hashes = getattr(request, "block_hashes", ())
        return (load.prefix_hash is not None and len(hashes) >= load.prefix_blocks
                and hashes[load.prefix_blocks - 1] == load.prefix_hash)

    def holds_all(self, load: DeferredLoad, step: int) -> bool:
        """Whether `load` has waited long enough to hold every newer request back, whatever it waits for."""
        return step - load.since >= self._grace
