"""A failed load must not be offered again to the same request (the soak stall of the segmented-LRU commit).

vLLM 0.33.0 (`kv_load_failure_policy: "recompute"`): a load reported in `failed_recving` sets the request's computed
tokens to 0 (`_handle_failed_recving`); when the scheduler next reaches it at the head of `kv_holding_waiting`,
`_update_waiting_for_remote_kv` frees its blocks and promotes it to WAITING, but leaves it in `_inflight_prefills`
and in `kv_holding_waiting`. Its fresh lookup then asks the connector again. If the tier still holds the prefix
(here: pinned by another request's load of the same prefix, so the failure could not drop it) and the connector
offers the load again, vLLM gates that async load against `_inflight_prefill_reserved_blocks()`, which now counts
the request's own full need (stale entry) on top of everyone else's: `allocate_slots` returns None and the waiting
loop `break`s, at the head of `kv_holding_waiting`, every step. A load that lands behind it is never promoted, its
blocks and reservation stay, and nothing is scheduled again. The connector's ledger (which excludes the request's
own row) admits the retry every time, so nothing ages out.

After a failed load the connector recomputes the request (`no_load`), as the recompute policy says: vLLM then
schedules its prefill without the async-load gate, and the load behind it is promoted.
"""

from __future__ import annotations

import pytest

from offload_bench.sim.custom import build_custom
from offload_bench.sim.driver import SchedulerDriver
from offload_bench.sim.faults import assert_ok, drain, status, step_invariants, step_until
from offload_bench.sim.requests import make_request, tokens
from offload_bench.sim.scenarios import connector_config
from offload_bench.sim.tagcopy import TagCopier

PREFIX = 320  # 20 blocks of 16 tokens, stored by a warm-up request
NEW = 320  # each loading request's own tokens: 640-token prompts, 40 blocks (41 through the first decode step)


def rig(groups, num_blocks: int) -> tuple[SchedulerDriver, int]:
    kvt = connector_config("exact", 4096 * 4096)
    kvt.kv_load_failure_policy = "recompute"
    sched, hbs = build_custom(groups, num_blocks=num_blocks, max_num_batched_tokens=1024, max_model_len=2048,
                              kv_transfer_config=kvt)
    engine = TagCopier(fail_load=lambda job: job.request_id == "a")
    return SchedulerDriver(sched, engine, batch_depth=1), hbs


def _release(drv: SchedulerDriver, rid: str) -> None:
    for item in drv.engine.inflight:
        if item.is_load and item.job.request_id == rid:
            item.due = drv.step_no


# Pools where the ledger admits the retry (its total fits next to b) but vLLM's gate, counting the retrying
# request's own stale reservation as well, does not.
@pytest.mark.parametrize("groups,num_blocks", [
    ((("full", 16, 0),), 91),
    ((("full", 16, 0), ("sliding", 16, 64)), 121),
], ids=["full", "full+sliding"])
def test_failed_load_ahead_of_a_landed_load_does_not_stall(groups, num_blocks):
    drv, hbs = rig(groups, num_blocks)
    prefix = tokens(1, PREFIX)
    drv.add([make_request("w", prefix + tokens(2, 1), 1, hbs)])  # stores the prefix in the CPU tier
    drain(drv)
    assert drv.sched.reset_prefix_cache()

    drv.engine.hold_loads = True  # both loads stay in flight until released one by one
    drv.add([make_request("a", prefix + tokens(3, NEW), 4, hbs)])
    step_until(drv, lambda d: "a" in d.side.view().loads, max_steps=5)
    drv.add([make_request("b", prefix + tokens(4, NEW), 4, hbs)])
    step_until(drv, lambda d: "b" in d.side.view().loads, max_steps=5)
    assert [r.request_id for r in drv.sched.kv_holding_waiting] == ["a", "b"]

    # a's load fails while b's, of the same prefix, still pins the tier entries: the prefix stays readable.
    _release(drv, "a")
    step_until(drv, lambda d: "a" not in d.side.view().loads, max_steps=5)
    assert drv.side.counters.load_failures == 1
    for _ in range(3):
        drv.step()
        assert_ok(step_invariants(drv))
    _release(drv, "b")
    drv.engine.hold_loads = False

    res = drv.run(max_steps=drv.step_no + 2000, stall_steps=50)
    assert not res.stalled, (f"stalled at step {res.first_stall_step}: a {status(drv, 'a')} "
                             f"b {status(drv, 'b')}, kv_holding_waiting "
                             f"{[r.request_id for r in drv.sched.kv_holding_waiting]}")
    assert {"a", "b"} <= drv.finished
    drain(drv)
    assert drv.side.counters.loads_admitted == 2  # a recomputed after its failed load; it was not offered again


@pytest.mark.parametrize("groups", [(("full", 16, 0),), (("full", 16, 0), ("sliding", 16, 64))],
                         ids=["full", "full+sliding"])
def test_a_failed_load_is_stored_again_by_its_recompute(groups):
    """A failed load drops the prefix's tier entries (nothing else pinned them); the request then recomputes the
    prefix, and must store it again: the store progress its load admission had advanced past the prefix goes back
    to the start. Before, the prefix stayed out of the tier (seen with TP=2, one rank failing the load: the next
    request for it missed, tests/engine/test_parallel_failures.py)."""
    drv, hbs = rig(groups, 200)
    prefix = tokens(1, PREFIX)
    drv.add([make_request("w", prefix + tokens(2, 1), 1, hbs)])  # stores the prefix in the CPU tier
    drain(drv)
    assert drv.sched.reset_prefix_cache()
    drv.add([make_request("a", prefix + tokens(3, 40), 2, hbs)])  # its load fails (rig: every load of "a")
    drain(drv)
    assert "a" in drv.finished and drv.side.counters.load_failures == 1
    assert drv.sched.reset_prefix_cache()
    before = drv.side.counters.loaded_tokens
    drv.add([make_request("b", prefix + tokens(4, 40), 2, hbs)])
    drain(drv)
    assert "b" in drv.finished and drv.side.counters.load_failures == 1
    assert drv.side.counters.loaded_tokens - before == PREFIX, "the recomputed prefix was not stored again"
