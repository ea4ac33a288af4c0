"""A prefill preempted past every point the tiers can restore resumes at the point it had reached, next time.

vLLM preempts the newest running request when the pool runs short, and a long prefill is often that request. What
it computed is freed; at its next admission the connector restores what the tiers hold. The windows it passed were
offered once, as spare entries, which a tier full of regular entries does not take; store planning had moved past
them and never offered them again, so every preemption cost the same recompute (in the decode-heavy replay on Gemma 4
31B at 16-token blocks one request was preempted 12 times in a row, recomputing from the same point each time). Now
the point it had reached becomes a junction: its window is stored as a regular entry by the recompute, as after a
failed load.
"""

from __future__ import annotations

import pytest

from offload_bench.sim.custom import build_custom
from offload_bench.sim.driver import SchedulerDriver
from offload_bench.sim.faults import assert_ok, drain, preempt, settle, step_invariants, step_until
from offload_bench.sim.requests import make_request, tokens
from offload_bench.sim.scenarios import connector_config
from offload_bench.sim.tagcopy import TagCopier

GROUPS = (("full", 16, 0), ("sliding", 16, 64))
SLOTS = 60  # CPU-tier slots: room for the preempted prompt's blocks and windows, not for the warm-up's as well
PROMPT = 640


def rig(cpu_bytes: int) -> tuple[SchedulerDriver, int]:
    # No checkpoints inside prompts: the points a prefill passes are spare windows only.
    kvt = connector_config("exact", cpu_bytes, window_checkpoint_tokens=0)
    sched, hbs = build_custom(GROUPS, num_blocks=400, max_num_batched_tokens=128, max_model_len=2048,
                              kv_transfer_config=kvt)
    return SchedulerDriver(sched, TagCopier(), batch_depth=1), hbs


def slot_bytes() -> int:
    drv, _ = rig(1 << 30)
    return (1 << 30) // drv.side.tier.capacity_slots + 1


@pytest.fixture(scope="module")
def per_slot() -> int:
    return slot_bytes()


def scene(per_slot: int) -> tuple[int, int]:
    """A prompt preempted after three 128-token chunks whose passed windows the full tier skipped, readmitted once its
    freed blocks are gone, run to the end; then a prompt sharing exactly the prefix it had reached. Returns (that
    prefix, the tokens the second prompt loaded from the CPU tier)."""
    drv, hbs = rig(SLOTS * per_slot)
    assert drv.side.tier.capacity_slots == SLOTS
    # A warm-up longer than the tier: it ends full of regular entries (spare ones go first), so spare windows of the
    # next prompt find no room.
    drv.add([make_request("w", tokens(1, 16 * (SLOTS + 8)), 1, hbs)])
    drain(drv)
    prompt = tokens(2, PROMPT)
    drv.add([make_request("p", prompt, 1, hbs)])
    step_until(drv, lambda d: d.sched.requests["p"].num_computed_tokens >= 3 * 128)
    settle(drv)
    reached = drv.side._requests["p"].window_scanned
    assert reached >= 256 and drv.side.tier.spare_skips > 0  # it passed points whose spare windows were skipped
    assert preempt(drv, "p")
    settle(drv)
    assert drv.sched.reset_prefix_cache()  # as a pool under pressure would have reused its freed blocks
    drain(drv)  # readmitted: restores less than it had reached, recomputes, finishes
    assert_ok(step_invariants(drv))
    assert drv.sched.reset_prefix_cache()
    before = drv.side.counters.loaded_tokens
    drv.add([make_request("q", prompt[:reached] + tokens(3, 96), 1, hbs)])
    drain(drv)
    return reached, drv.side.counters.loaded_tokens - before


def test_a_preempted_prefill_stores_the_point_it_had_reached(per_slot):
    reached, loaded = scene(per_slot)
    assert loaded == reached


def test_without_the_rule_the_point_is_lost(per_slot, monkeypatch):
    """The same scene with the rule taken out (no junction, no restart): the shared prefix is recomputed, so the test
    above is not vacuous."""
    from offload_connector.scheduler.state import ReqState

    monkeypatch.setattr(ReqState, "restart_windows", lambda self: None)
    real_init = ReqState.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.junctions = _NoAdd()

    monkeypatch.setattr(ReqState, "__init__", init)
    reached, loaded = scene(per_slot)
    assert loaded < reached


class _NoAdd(set):
    def add(self, item: object) -> None:  # every junction dropped: the rule's (the others come after what is measured)
        return None
