"""Aborts, preemption and failures at every stage of a request's life, through vLLM's real scheduler.

Each test drives `Scheduler` and our real worker over the tag-copying backend of `sim/tagcopy.py` (held jobs,
per-direction latency, injected failures), acts at one exact stage, drains, and checks (`faults.drained_invariants`):
the GPU pool is back to num_blocks - 1 free with every reference count 0; vLLM and the connector's scheduler side hold no request, load,
orphaned load, store job, block reader or delayed free; the CPU tier has no pinned and no unpublished entry, its host
slots add up, and every readable entry's host slot holds its own tokens' tag (nothing failed or half-written is ever
published). At every step `faults.step_invariants` checks that each tier pin is explained by an in-flight job. Then
a later request with the same prefix loads it from the tier and the driver checks the loaded tags.
"""

from __future__ import annotations

import zlib

import pytest

from offload_bench.sim.custom import build_custom
from offload_bench.sim.driver import SchedulerDriver
from offload_bench.sim.faults import (
    abort,
    assert_ok,
    drain,
    hold_inflight,
    preempt,
    readable_keys,
    settle,
    status,
    step_invariants,
    step_until,
)
from offload_bench.sim.requests import make_request, tokens
from offload_bench.sim.scenarios import connector_config
from offload_bench.sim.tagcopy import TagCopier

GROUPS = (("full", 16, 0), ("sliding", 16, 64))
SLOT_BYTES = 4096  # one block of either group: 2 x 16 tokens x 1 head x 64 x bf16
PREFIX = 320  # tokens of the stored prefix (20 full-attention blocks, a 4-block window)


def rig(*, num_blocks: int = 160, cpu_slots: int = 4096, batch: int = 64, depth: int | None = None,
        spare_windows: bool = False, **engine):
    """vLLM's Scheduler over a full-attention + sliding-window layout; `depth` 2 is EngineCore's async batch queue
    (the default for this async-scheduling config), 1 a synchronous engine. `engine`: TagCopier knobs. The tests
    count exactly which windows the rules store, so spare windows are off unless a test asks for them
    (tests/sim/test_lifecycle_property.py runs the lifecycle with them), and checkpoints are pinned far apart (the spacing
    derived for this small window, tests/unit/test_checkpoint_spacing.py, would store a window every few blocks)."""
    kvt = connector_config("exact", cpu_slots * SLOT_BYTES, spare_windows=spare_windows, window_checkpoint_tokens=8192)
    sched, hbs = build_custom(GROUPS, num_blocks=num_blocks, max_num_batched_tokens=batch, max_model_len=2048,
                              kv_transfer_config=kvt)
    drv = SchedulerDriver(sched, TagCopier(**engine), batch_depth=depth)
    assert drv.side.slot_bytes == SLOT_BYTES
    return drv, hbs


def warm(drv, hbs, prompt, rid="w", reset=True):
    """Compute `prompt` once (the connector stores it), then drop it from the GPU prefix cache."""
    drv.add([make_request(rid, prompt, 1, hbs)])
    drain(drv)
    if reset:
        assert drv.sched.reset_prefix_cache()


def reload_ok(drv, hbs, prefix, rid, at_least=None):
    """A later request with `prefix` (plus new tokens) loads it from the CPU tier; the driver checks every tag."""
    assert drv.sched.reset_prefix_cache()
    before = drv.side.counters.loaded_tokens
    drv.add([make_request(rid, list(prefix) + tokens(5000 + zlib.crc32(rid.encode()) % 1000, 24), 2, hbs)])
    drain(drv)
    assert rid in drv.finished
    loaded = drv.side.counters.loaded_tokens - before
    want = len(prefix) // 16 * 16 if at_least is None else at_least
    assert loaded >= want, (loaded, want)
    return loaded


def in_load(rid):
    return lambda d: status(d, rid) == "WAITING_FOR_REMOTE_KVS" and rid in d.side.view().loads


# --------------------------------------------------------------------------- (a) lookup deferred
@pytest.mark.parametrize("depth", [1, 2])
def test_abort_while_lookup_is_deferred(depth):
    drv, hbs = rig(num_blocks=100, depth=depth)
    prefix = tokens(1, PREFIX)
    warm(drv, hbs, prefix)
    # A long cold prompt in prefill holds the pool's remaining need: the returning load does not fit next to it.
    drv.add([make_request("blocker", tokens(2, 1200), 2, hbs)])
    drv.step()
    drv.step()
    drv.add([make_request("r", prefix + tokens(3, 40), 4, hbs)])
    step_until(drv, lambda d: d.side.view().requests["r"].deferred_since is not None, max_steps=20)
    assert status(drv, "r") == "WAITING" and "r" not in drv.side.view().loads
    assert drv.side.counters.deferrals > 0
    drv.step()  # deferred once more
    assert abort(drv, "r")
    assert "r" not in drv.sched.requests and "r" not in drv.side.view().requests
    drain(drv)
    assert "blocker" in drv.finished
    reload_ok(drv, hbs, prefix, "again")


# ------------------------------------------------------------------------ (b) load in flight
@pytest.mark.parametrize("load_fails", [False, True])
@pytest.mark.parametrize("depth", [1, 2])
def test_abort_while_load_is_in_flight(depth, load_fails):
    drv, hbs = rig(depth=depth, hold_loads=True, fail_load=(lambda job: job.request_id == "r") if load_fails else None)
    prefix = tokens(1, PREFIX)
    warm(drv, hbs, prefix)
    drv.add([make_request("r", prefix + tokens(3, 40), 4, hbs)])
    step_until(drv, in_load("r"), max_steps=10)
    drv.step()
    drv.step()
    keys = list(drv.side.view().loads["r"].keys)
    assert all(drv.side.tier.pin_count(k) == 1 for k in keys)
    free_before = drv.pool.get_num_free_blocks()
    assert abort(drv, "r")
    # vLLM keeps the blocks the copy writes into until the load reports; the tier entries stay pinned meanwhile.
    assert drv.pool.get_num_free_blocks() == free_before
    assert [o.job.request_id for o in drv.side.view().orphan_loads.values()] == ["r"]
    assert all(drv.side.tier.pin_count(k) == 1 for k in keys)
    # Other work meanwhile: a cold request computes and stores.
    drv.add([make_request("other", tokens(4, 200), 2, hbs)])
    for _ in range(4):
        drv.step()
        assert_ok(step_invariants(drv))
    assert all(drv.side.tier.pin_count(k) == 1 for k in keys)
    drv.engine.release(drv.step_no)
    drain(drv)
    ready = readable_keys(drv.side)
    if load_fails:
        # A load that failed marks its source entries bad: they are dropped, not served again.
        assert not any(k in ready for k in keys) and drv.side.counters.load_failures == 1
        drv.add([make_request("recompute", prefix + tokens(6, 8), 1, hbs)])  # stores the prefix again
        drain(drv)
    else:
        assert all(k in ready for k in keys)
    reload_ok(drv, hbs, prefix, "again")


# -------------------------------------------------------------------- (c) right after the load
@pytest.mark.parametrize("moment", ["landed_not_consumed", "first_chunk_scheduled"])
@pytest.mark.parametrize("depth", [1, 2])
def test_abort_right_after_load_completes(depth, moment):
    drv, hbs = rig(depth=depth, load_latency=2, store_latency=3)
    prefix = tokens(1, PREFIX)
    warm(drv, hbs, prefix)
    drv.add([make_request("r", prefix + tokens(3, 100), 4, hbs)])
    if moment == "landed_not_consumed":
        # vLLM has the completion but has not yet moved the request out of WAITING_FOR_REMOTE_KVS.
        step_until(drv, lambda d: "r" in d.sched.finished_recving_kv_req_ids, max_steps=20)
        assert status(drv, "r") == "WAITING_FOR_REMOTE_KVS" and "r" not in drv.side.view().loads
    else:
        step_until(drv, lambda d: status(d, "r") == "RUNNING", max_steps=20)
        assert drv.sched.requests["r"].num_computed_tokens > PREFIX
    assert abort(drv, "r")
    drain(drv)
    assert drv.side.counters.loads_admitted == 1
    reload_ok(drv, hbs, prefix, "again")


# ----------------------------------------------------------------------- (d) stores in flight
@pytest.mark.parametrize("moment", ["mid_prefill", "prompt_done"])
@pytest.mark.parametrize("depth", [1, 2])
def test_abort_while_stores_are_in_flight(depth, moment):
    drv, hbs = rig(depth=depth, hold_stores=True)
    prompt = tokens(7, 400)
    drv.add([make_request("s", prompt, 4, hbs)])
    if moment == "mid_prefill":
        step_until(drv, lambda d: len(d.engine.inflight_jobs("store", "s")) >= 2, max_steps=20)
    else:
        step_until(drv, lambda d: d.sched.requests["s"].num_output_tokens >= 1, max_steps=40)
    stored = [k for job_keys in (v.keys for v in drv.side.view().store_jobs.values()) for k in job_keys]
    assert stored and not any(drv.side.tier.is_ready(k) for k in stored)  # in flight: not readable
    assert abort(drv, "s")
    # The connector keeps the aborted request's blocks until its stores have read them.
    assert "s" in drv.side.view().awaiting_free and "s" in drv.sched.requests
    held = drv.pool.get_num_free_blocks()
    assert held < drv.sched.kv_cache_config.num_blocks - 1
    stored = [k for job_keys in (v.keys for v in drv.side.view().store_jobs.values()) for k in job_keys]
    for _ in range(3):
        drv.step()
        assert_ok(step_invariants(drv))
        assert drv.pool.get_num_free_blocks() == held and not any(drv.side.tier.is_ready(k) for k in stored)
    drv.engine.release(drv.step_no)
    drain(drv)
    assert all(drv.side.tier.is_ready(k) for k in stored)
    if moment == "prompt_done":
        # Its whole prompt (full-attention blocks and the window at the prompt's end) comes back.
        reload_ok(drv, hbs, prompt, "again", at_least=400)
    else:
        # Aborted mid-prefill: the full-attention blocks are kept, but no window was stored, so this hybrid layout
        # cannot resume there; a later request recomputes and stores the prompt, and the one after loads it.
        assert drv.sched.reset_prefix_cache()
        assert drv.side.admission.hit(make_request("probe", prompt + [1], 1, hbs), 400) == 0
        drv.add([make_request("s2", prompt, 1, hbs)])
        drain(drv)
        reload_ok(drv, hbs, prompt, "again", at_least=400)


def test_abort_mid_prefill_with_spare_windows_resumes_where_its_stores_landed():
    """With spare windows the windows a prefill passed through are stored too: once the aborted request's stores
    land, a later request resumes at the last boundary they reached instead of recomputing the whole prompt."""
    drv, hbs = rig(depth=2, hold_stores=True, spare_windows=True)
    prompt = tokens(7, 400)
    drv.add([make_request("s", prompt, 4, hbs)])
    step_until(drv, lambda d: len(d.engine.inflight_jobs("store", "s")) >= 2, max_steps=20)
    done = drv.sched.requests["s"].num_computed_tokens
    assert abort(drv, "s")
    drv.engine.release(drv.step_no)
    drain(drv)
    assert drv.sched.reset_prefix_cache()
    hit = drv.side.admission.hit(make_request("probe", prompt + [1], 1, hbs), 400)
    assert 0 < hit <= done
    assert_ok(step_invariants(drv))


@pytest.mark.parametrize("which", ["all", "second"])
def test_failed_stores_never_publish(which, record_store_keys):
    """A store the worker reports failed publishes nothing: its entries are dropped, its slots reused; a hole in a
    prefix limits later hits to the part before it."""
    jobs_seen: list[int] = []

    def fail(job):
        if job.request_id != "s":
            return False
        jobs_seen.append(job.job_id)
        return which == "all" or len(jobs_seen) == 2

    drv, hbs = rig(store_latency=2, fail_store=fail)
    prompt = tokens(7, 400)
    drv.add([make_request("s", prompt, 1, hbs)])
    drain(drv)
    failed_keys = [k for step, kind, job, ok in drv.engine.completed if kind == "store" and not ok
                   for k in _job_keys(drv, job)]
    assert drv.engine.stores_failed >= 1 and failed_keys
    ready = readable_keys(drv.side)
    assert not any(k in ready for k in failed_keys)
    assert drv.sched.reset_prefix_cache()
    probe = make_request("probe", prompt + [7], 1, hbs)
    hit = drv.side.admission.hit(probe, len(prompt))
    # Nothing after the failed job can be resumed from (and before it no sliding window was stored).
    assert hit == 0
    if which == "all":
        assert len(drv.side.tier) == 0
    else:
        assert drv.engine.stores_done > 0 and len(drv.side.tier) > 0
    # The prefix is computed and stored again, then served correctly.
    drv.add([make_request("s2", prompt, 1, hbs)])
    drain(drv)
    reload_ok(drv, hbs, prompt, "again")


_KEYS: dict[int, list] = {}


def _job_keys(drv, job):
    """The tier keys of a store job (recorded when the job was planned; see the fixture below)."""
    return _KEYS.get(job.job_id, [])


@pytest.fixture
def record_store_keys(monkeypatch):
    from offload_connector.scheduler.jobs import JobBook

    _KEYS.clear()
    original = JobBook.add_store

    def adding(self, job, keys, events):
        _KEYS[job.job_id] = list(keys)
        original(self, job, keys, events)

    monkeypatch.setattr(JobBook, "add_store", adding)


# ----------------------------------------------------------------------------- (e) decode
@pytest.mark.parametrize("depth", [1, 2])
def test_abort_during_decode(depth):
    drv, hbs = rig(depth=depth, store_latency=3)
    prefix = tokens(1, PREFIX)
    warm(drv, hbs, prefix)
    prompt = prefix + tokens(3, 30)
    drv.add([make_request("r", prompt, 200, hbs)])
    step_until(drv, lambda d: d.sched.requests["r"].num_output_tokens >= 40, max_steps=200)
    assert drv.side.counters.loads_admitted == 1 and status(drv, "r") == "RUNNING"
    computed = drv.sched.requests["r"].num_computed_tokens
    assert computed > len(prompt) + 32
    assert abort(drv, "r")
    drain(drv)
    # The next turn of the conversation resumes from the tier past the prompt, at the last decode boundary stored.
    history = prompt + [7] * (computed - len(prompt))
    reload_ok(drv, hbs, history, "again", at_least=(len(prompt) // 16 + 1) * 16)


# ------------------------------------------------------------------------------ preemption
def _record_preemptions(drv):
    """Wrap vLLM's `_preempt_request`: (request id, store jobs it had in flight, was it running after a load)."""
    seen = []
    original = drv.sched._preempt_request

    def preempting(request, *args, **kwargs):
        state = drv.side.view().requests.get(request.request_id)
        seen.append((request.request_id, set(state.pending_stores) if state else set()))
        return original(request, *args, **kwargs)

    drv.sched._preempt_request = preempting
    return seen


@pytest.mark.parametrize("depth", [1, 2])
def test_pool_pressure_preempts_requests_with_stores_in_flight(depth):
    drv, hbs = rig(num_blocks=72, depth=depth, store_latency=4)
    seen = _record_preemptions(drv)
    prompts = {f"d{i}": tokens(20 + i, 160) for i in range(3)}
    drv.add([make_request(rid, p, 320, hbs) for rid, p in prompts.items()])
    drain(drv, max_steps=6000)
    assert set(prompts) <= drv.finished
    assert seen, "the pool was meant to force vLLM to preempt"
    assert any(stores for _rid, stores in seen), seen  # a victim had stores in flight
    for rid, p in prompts.items():
        reload_ok(drv, hbs, p + [7] * 100, f"again-{rid}", at_least=160)


@pytest.mark.parametrize("depth", [1, 2])
def test_preempt_right_after_load(depth):
    drv, hbs = rig(depth=depth, store_latency=3)
    prefix = tokens(1, PREFIX)
    warm(drv, hbs, prefix)
    drv.add([make_request("r", prefix + tokens(3, 100), 8, hbs)])
    step_until(drv, lambda d: status(d, "r") == "RUNNING", max_steps=20)
    assert preempt(drv, "r")
    drain(drv)
    assert "r" in drv.finished and drv.sched.requests.get("r") is None
    reload_ok(drv, hbs, prefix, "again")


@pytest.mark.parametrize("depth", [1, 2])
def test_preempted_with_stores_in_flight_then_reloaded_then_aborted_mid_load(depth):
    """A preempted request keeps stores in flight, comes back through an async load, and is aborted while that load
    is in flight: vLLM frees its blocks when the load reports, and must be told nothing else about it."""
    drv, hbs = rig(depth=depth, store_latency=1, load_latency=1)
    prefix = tokens(1, PREFIX)
    warm(drv, hbs, prefix)
    drv.add([make_request("r", prefix + tokens(3, 200), 40, hbs)])
    step_until(drv, lambda d: status(d, "r") == "RUNNING" and d.sched.requests["r"].num_computed_tokens > PREFIX + 64,
               max_steps=40)
    step_until(drv, lambda d: len(d.engine.inflight_jobs("store", "r")) >= 1, max_steps=20)
    held = hold_inflight(drv, "store", "r")
    assert preempt(drv, "r")
    settle(drv)
    assert drv.sched.reset_prefix_cache()  # only the CPU tier has r's prefix now: it comes back through a load
    drv.engine.hold_loads = True
    step_until(drv, in_load("r"), max_steps=20)
    assert {j.job_id for j in held} <= drv.side.view().requests["r"].pending_stores
    assert abort(drv, "r")
    drv.engine.release(drv.step_no)
    drain(drv)
    reload_ok(drv, hbs, prefix, "again")


def test_preempted_request_blocks_reused_while_its_stores_are_in_flight():
    """vLLM frees a preempted request's blocks at once; stores still reading them are fenced before another request's
    forward writes them, and publish the preempted request's own tokens."""
    drv, hbs = rig(num_blocks=140, store_latency=1)
    prompt = tokens(11, 400)
    drv.add([make_request("r", prompt, 60, hbs)])
    step_until(drv, lambda d: d.sched.requests["r"].num_output_tokens >= 2
               and len(d.engine.inflight_jobs("store", "r")) >= 1, max_steps=60)
    held = hold_inflight(drv, "store", "r")
    drv.engine.hold_stores = False  # only the stores in flight at the preemption are held
    assert preempt(drv, "r")
    settle(drv)
    assert drv.sched.reset_prefix_cache()  # the freed blocks lose their hashes: they are reallocated as fresh blocks
    # r comes back through a load of its stored prompt, and a prompt that needs most of the pool takes the blocks
    # the held stores still read.
    drv.add([make_request("big", tokens(12, 1300), 2, hbs)])
    step_until(drv, lambda d: d.engine.fenced > 0, max_steps=400)
    fenced = [i for i in drv.engine.inflight if i.captured is not None]
    assert {i.job.job_id for i in fenced} & {j.job_id for j in held}
    drv.engine.release(drv.step_no)
    drain(drv)  # every published entry holds its own key's tag (step/drained invariants)
    assert {"r", "big"} <= drv.finished
    reload_ok(drv, hbs, prompt, "again", at_least=400)


# --------------------------------------------------------------------------------- full tier
def test_full_tier_rejects_or_evicts_idle_entries_never_pinned_ones():
    from offload_connector import metrics

    drv, hbs = rig(cpu_slots=30, num_blocks=200)
    collected = []
    conn = drv.sched.get_kv_connector()
    take = conn.get_kv_connector_stats

    def taking():
        stats = take()
        if stats is not None:
            collected.append(stats.data[metrics.COUNTERS].get(metrics.EVICTIONS, 0))
        return stats

    conn.get_kv_connector_stats = taking
    prefix = tokens(1, PREFIX)
    warm(drv, hbs, prefix)
    tier = drv.side.tier
    # 20 full-attention blocks and the 4-block window at the prompt's end, where the same prompt sent again resumes
    # (it is loaded whole: `lookup.hit_upper`; before, the window one block earlier was kept too: 25).
    assert len(tier) == 24
    drv.engine.hold_loads = True
    drv.add([make_request("r", prefix + tokens(3, 40), 3, hbs)])
    step_until(drv, in_load("r"), max_steps=10)
    pinned = list(drv.side.view().loads["r"].keys)
    assert len(pinned) == 24
    # Many requests compute and try to store while the load holds 24 of the 30 slots.
    drv.add([make_request(f"c{i}", tokens(40 + i, 200), 2, hbs) for i in range(8)])
    step_until(drv, lambda d: all(f"c{i}" in d.finished for i in range(8)), max_steps=400)
    for _ in range(3):
        drv.step()
    assert all(tier.pin_count(k) == 1 and tier.is_ready(k) for k in pinned)
    assert tier.store_rejections > 0 and tier.evictions > 0
    assert len(tier) <= tier.capacity_slots
    drv.engine.release(drv.step_no)
    drain(drv)  # the driver checks the loaded tags
    assert "r" in drv.finished and drv.side.counters.loaded_tokens >= PREFIX
    # Evictions reach the metrics; rejected stores have no counter in the metrics sink (TierIndex.store_rejections).
    take()
    assert sum(collected) == tier.evictions
    # Once the load is done its entries are ordinary idle entries again: new stores may evict them.
    before = tier.evictions
    drv.add([make_request("late", tokens(60, 400), 1, hbs)])
    drain(drv)
    assert tier.evictions > before
