"""`reset_cache()` (vLLM's `reset_prefix_cache(reset_connector=True)`) and the CPU tier's KV cache events, through
vLLM's real scheduler and our real worker over the tag-copying backend `sim/tagcopy.py` (the lifecycle rig of
tests/sim/test_lifecycle.py).

A reset frees idle entries at once; a copy in flight keeps its slots (retired) until the worker reports it, and
`faults.step_invariants` checks after every step that each retired slot is explained by exactly the jobs issued
before the reset and that no entry or free slot shares it. The driver checks every loaded block's tag, so a slot
reused under a copy would show up as a wrong load. The real-engine counterparts are in tests/engine/test_engine_operations.py.
"""

from __future__ import annotations

import pytest

from offload_connector.scheduler.events import TierEvents
from offload_bench.sim.faults import assert_ok, drain, readable_keys, step_invariants, step_until
from offload_bench.sim.requests import make_request, tokens
from tests.sim.test_lifecycle import PREFIX, in_load, reload_ok, rig, warm


def loads_now(drv, hbs, prompt, rid):
    """Tokens the connector loads for a request `prompt` + 24 new tokens after a GPU-only prefix-cache reset."""
    assert drv.sched.reset_prefix_cache()
    before = drv.side.counters.loaded_tokens
    drv.add([make_request(rid, list(prompt) + tokens(900 + len(rid), 24), 2, hbs)])
    drain(drv)
    assert rid in drv.finished
    return drv.side.counters.loaded_tokens - before


def ext(block_hash):
    """A tier key's hash as KV cache events carry it (vLLM's conversion, as for the GPU pool's events)."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    return maybe_convert_block_hash(block_hash)


def with_events(drv):
    """Turn the tier's KV cache events on (as `--kv-events-config` does) and record what vLLM drains each step."""
    side = drv.side
    side.events = TierEvents(True, side.groups, drv.sched.kv_cache_config)  # also hooks the tier's removals
    assert side.tier.on_removed == side.events.removed
    seen: list = []
    conn = drv.sched.get_kv_connector()
    orig = conn.take_events

    def take_events():
        out = list(orig())
        seen.extend(out)
        return out
    conn.take_events = take_events
    return seen


def test_reset_empties_the_tier_and_the_next_request_loads_nothing():
    drv, hbs = rig()
    prefix = tokens(1, PREFIX)
    warm(drv, hbs, prefix)
    assert loads_now(drv, hbs, prefix, "before") >= PREFIX // 16 * 16  # the tier serves it without a reset
    assert len(drv.side.tier) > 0
    # What `POST /reset_prefix_cache?reset_external=true` calls: the GPU cache, then the connector's reset_cache().
    assert drv.sched.reset_prefix_cache(reset_connector=True)
    assert len(drv.side.tier) == 0 and drv.side.tier.used_slots() == 0 and not readable_keys(drv.side)
    assert_ok(step_invariants(drv))
    assert loads_now(drv, hbs, prefix, "after") == 0
    # The tier fills again with what is computed after the reset.
    warm(drv, hbs, prefix, rid="w2")
    assert loads_now(drv, hbs, prefix, "refilled") >= PREFIX // 16 * 16
    assert drv.side.resets == 1


def test_reset_with_a_load_in_flight_keeps_its_slots_until_it_lands():
    drv, hbs = rig(hold_loads=True)
    prefix = tokens(1, PREFIX)
    warm(drv, hbs, prefix)
    prompt = prefix + tokens(3, 40)
    drv.add([make_request("r", prompt, 4, hbs)])
    step_until(drv, in_load("r"), max_steps=10)
    drv.step()
    load = drv.side.view().loads["r"]
    assert drv.sched.get_kv_connector().reset_cache() is True
    tier = drv.side.tier
    # The copy still reads its slots: they are retired, not free, and no lookup finds the prefix.
    assert set(tier.view().retired) == set(load.job.host_slots) and not readable_keys(drv.side)
    assert_ok(step_invariants(drv))
    # New stores meanwhile (a cold request) never get a retired slot (step_invariants checks every step).
    drv.add([make_request("other", tokens(4, 300), 2, hbs)])
    for _ in range(12):
        drv.step()
        assert_ok(step_invariants(drv))
        assert not set(tier.view().retired) & {e.slot for e in tier.view().entries.values()}
    assert set(tier.view().retired) == set(load.job.host_slots)
    drv.engine.release(drv.step_no)
    drain(drv)  # the load lands (its tags checked), the slots come back, every invariant holds
    assert "r" in drv.finished and tier.stats().retired_slots == 0
    # "r" was admitted before the reset and kept its load; running after it, it stored its prompt again.
    reload_ok(drv, hbs, prompt, "again", at_least=PREFIX)


@pytest.mark.parametrize("moment", ["finished", "running", "running_reset_twice"])
def test_reset_with_stores_in_flight_never_publishes_them(moment):
    drv, hbs = rig(hold_stores=True)
    prompt = tokens(7, 400)
    drv.add([make_request("s", prompt, 4, hbs)])
    if moment == "finished":  # done, its blocks kept for the stores still reading them
        step_until(drv, lambda d: "s" in d.side.view().awaiting_free, max_steps=60)
    else:
        step_until(drv, lambda d: d.sched.requests["s"].num_output_tokens >= 1, max_steps=40)
    stale = {job_id: list(job.keys) for job_id, job in drv.side.view().store_jobs.items()}
    assert stale
    assert drv.side.reset_cache()
    tier = drv.side.tier
    assert tier.stats().retired_slots == sum(len(k) for k in stale.values()) and len(tier) == 0
    assert_ok(step_invariants(drv))
    if moment == "running_reset_twice":
        # Still running, it stores the same keys again into fresh slots; a second reset retires those too, while
        # the first reset's jobs keep exactly their own slots.
        step_until(drv, lambda d: len(d.side.view().store_jobs) > len(stale), max_steps=20)
        assert any(tier.has(k) for keys in stale.values() for k in keys)
        assert drv.side.reset_cache()
        assert_ok(step_invariants(drv))
        assert tier.stats().retired_slots == sum(len(job.keys) for job in drv.side.view().store_jobs.values())
    drv.engine.release(drv.step_no)
    drain(drv)
    # Stores issued before the reset landed into retired slots and were never published; their slots are free.
    assert tier.stats().retired_slots == 0
    if moment == "finished":
        assert not readable_keys(drv.side) and tier.used_slots() == 0
        assert loads_now(drv, hbs, prompt, "after") == 0
    elif moment == "running":
        # Still running at the reset, it stored its blocks again from the start (progress reset), after the reset.
        assert {k for keys in stale.values() for k in keys} & readable_keys(drv.side)
        reload_ok(drv, hbs, prompt, "again", at_least=400)


def test_events_report_stores_evictions_and_reset():
    drv, hbs = rig(cpu_slots=40)
    seen = with_events(drv)
    a = tokens(1, PREFIX)
    warm(drv, hbs, a)
    stored = [e for e in seen if type(e).__name__ == "BlockStored"]
    assert stored and all(e.medium == "CPU" for e in stored)
    side = drv.side
    ready = readable_keys(side)
    announced = {(e.group_idx, h) for e in stored for h in e.block_hashes}
    assert announced == {(g, ext(h)) for g, h in ready}, "every readable entry announced, nothing else"
    # Event payloads look like the GPU pool's: a run of consecutive blocks of one group, its tokens, its parent.
    full = [e for e in stored if e.group_idx == 0]
    first = min(full, key=lambda e: e.parent_block_hash is not None)
    assert first.parent_block_hash is None and first.block_size == 16
    assert first.token_ids == a[: 16 * len(first.block_hashes)]
    assert first.kv_cache_spec_kind is not None
    for e in stored:
        assert len(e.token_ids) == e.block_size * len(e.block_hashes)
    # A second prompt overflows the 40-slot tier: evicted entries are announced removed.
    seen.clear()
    drv.add([make_request("b", tokens(2, PREFIX), 1, hbs)])
    drain(drv)
    removed = [e for e in seen if type(e).__name__ == "BlockRemoved"]
    assert side.tier.evictions > 0 and removed and all(e.medium == "CPU" for e in removed)
    gone = {(e.group_idx, h) for e in removed for h in e.block_hashes}
    assert len(gone) == side.tier.evictions and not gone & {(g, ext(h)) for g, h in readable_keys(side)}
    # A reset announces every readable entry removed; the events wait for the next step (has_pending_work).
    seen.clear()
    ready = {(g, ext(h)) for g, h in readable_keys(side)}
    assert side.reset_cache()
    assert side.has_pending_work()
    drv.step()
    gone = {(e.group_idx, h) for e in seen if type(e).__name__ == "BlockRemoved" for h in e.block_hashes}
    assert gone == ready and not any(type(e).__name__ == "AllBlocksCleared" for e in seen)
    assert not side.has_pending_work()


def test_events_off_by_default_and_startup_step():
    drv, hbs = rig()
    side = drv.side
    assert not side.events.enabled and side.tier.on_removed is None
    # Before its first step the connector asks vLLM for one (its stats carry the tier's capacity to /metrics).
    assert side.has_pending_work() and drv.sched.has_requests()
    drv.step()
    assert not side.has_pending_work()
    warm(drv, hbs, tokens(1, 64))
    assert side.take_events() == []
