"""Checks that no request ever holds more blocks per KV cache group than the ledger reserved for it.

Two views, both read after every `schedule()` (where vLLM frees out-of-window blocks and allocates new ones):

* per admitted load: the peak real blocks per group, from the load's allocation through the request's first decode
  step, against what the ledger reserved at admission (`plan.live + plan.remaining`);
* per step: every request the ledger counted as a block holder still in its prompt before the step holds, after it,
  no more than its row said it could (`held + remaining`).

Either kind of excess would let admission undercount, which is how the stall starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from offload_connector.scheduler import ledger


@dataclass
class _Tracked:
    reserved: tuple[int, ...]
    peak: list[int]
    prompt_tokens: int


@dataclass
class PeakChecker:
    violations: list[str] = field(default_factory=list)
    loads_checked: int = 0
    _tracked: dict[str, _Tracked] = field(default_factory=dict)
    _seen: set[int] = field(default_factory=set)
    _row_bounds: dict[str, tuple[int, ...]] = field(default_factory=dict)
    _computed_before: dict[str, int] = field(default_factory=dict)

    def before_schedule(self, sched: Any, side: Any) -> None:
        self._row_bounds = {row.request_id: tuple(h + r for h, r in zip(row.held, row.remaining))
                            for row in side.snapshot().rows}
        self._computed_before = {rid: req.num_computed_tokens for rid, req in sched.requests.items()}

    def after_schedule(self, sched: Any, side: Any, step: int) -> None:
        managers = list(sched.kv_cache_manager.coordinator.single_type_managers)

        def live(rid: str) -> list[int]:
            return [ledger.live_counts(m.req_to_blocks.get(rid, ()))[1] for m in managers]

        for rid, bound in self._row_bounds.items():
            if rid not in sched.requests:
                continue
            now = live(rid)
            if any(n > b for n, b in zip(now, bound)):
                self.violations.append(f"step {step}: {rid} holds {now} blocks per group, its ledger row allowed "
                                       f"{list(bound)}")
        self._adopt_admissions(sched, side)
        for rid, tr in list(self._tracked.items()):
            req = sched.requests.get(rid)
            before = self._computed_before.get(rid, 0)
            if req is None or req.num_computed_tokens == 0 or before > tr.prompt_tokens:
                # Finished, preempted (its next admission is a new reservation) or past its first decode step.
                self._finish(rid, tr)
                continue
            tr.peak = [max(p, n) for p, n in zip(tr.peak, live(rid))]

    def _adopt_admissions(self, sched: Any, side: Any) -> None:
        # vLLM allocates an admitted load inside the same schedule() call or never, so each admission is looked at
        # once, on the step it was made.
        fresh = []
        for adm in reversed(side.admissions):
            if id(adm) in self._seen:
                break
            fresh.append(adm)
        self._seen = {id(a) for a in side.admissions}
        for adm in reversed(fresh):
            if adm.free_after is None:
                continue  # refused by vLLM after our verdict, or only logged (reservation "vllm")
            reserved = tuple(lv + rem for lv, rem in zip(adm.plan.live, adm.plan.remaining))
            req = sched.requests.get(adm.request_id)
            prompt = req.num_prompt_tokens if req is not None else 0
            old = self._tracked.pop(adm.request_id, None)
            if old is not None:
                self._finish(adm.request_id, old)
            self._tracked[adm.request_id] = _Tracked(reserved, list(adm.live_after), prompt)
            self.loads_checked += 1

    def _finish(self, rid: str, tr: _Tracked) -> None:
        self._tracked.pop(rid, None)
        if any(p > r for p, r in zip(tr.peak, tr.reserved)):
            self.violations.append(f"{rid}: peak live blocks per group {tr.peak} exceed the reservation "
                                   f"{list(tr.reserved)} made at admission")

    def close(self) -> None:
        for rid, tr in list(self._tracked.items()):
            self._finish(rid, tr)
