"""The scheduler side's job book (`scheduler/jobs.py`) keeps its invariants through loads, stores, failures, aborts
and resets, driven through vLLM's real scheduler and our real worker (the lifecycle rig of tests/sim/test_lifecycle.py):
`OffloadScheduler.check()` after every step. Also: `check()` catches a broken book, and the read-only view and the
admission log behave as documented."""

from __future__ import annotations

import dataclasses

import pytest

from offload_bench.sim.custom import build_custom
from offload_bench.sim.driver import SchedulerDriver
from offload_bench.sim.faults import abort, drain, step_until
from offload_bench.sim.requests import make_request, tokens
from offload_bench.sim.scenarios import connector_config
from offload_bench.sim.tagcopy import TagCopier
from tests.sim.test_lifecycle import GROUPS, PREFIX, SLOT_BYTES, in_load, rig, warm


def checked(drv: SchedulerDriver, steps: int) -> None:
    for _ in range(steps):
        drv.step()
        drv.side.check()


def drain_checked(drv: SchedulerDriver, max_steps: int = 3000) -> None:
    for _ in range(max_steps):
        if not drv.busy():
            break
        checked(drv, 1)
    drain(drv)  # the lifecycle invariants, then the drained ones
    drv.side.check()
    assert not drv.side.view().leftovers()


def test_loads_and_stores_keep_the_book_consistent():
    drv, hbs = rig(store_latency=2, load_latency=2)
    prefix = tokens(1, PREFIX)
    drv.add([make_request("w", prefix, 1, hbs)])
    step_until(drv, lambda d: d.side.view().store_jobs, max_steps=20)
    view = drv.side.view()
    assert all(view.store_jobs[j].request_id == "w" for j in view.job_blocks)
    assert {b for blocks in view.job_blocks.values() for b in blocks} == set(view.block_readers)
    drain_checked(drv)
    assert drv.sched.reset_prefix_cache()
    drv.add([make_request("r", prefix + tokens(3, 40), 4, hbs)])
    step_until(drv, in_load("r"), max_steps=10)
    drv.side.check()
    load = drv.side.view().loads["r"]
    assert load.job.request_id == "r" and len(load.keys) == load.job.num_blocks and load.tokens > 0
    drain_checked(drv)
    assert "r" in drv.finished and drv.side.counters.loaded_tokens >= PREFIX // 16 * 16


@pytest.mark.parametrize("fail", ["load", "store"])
def test_failed_jobs_leave_nothing_behind(fail):
    engine = {"fail_load": lambda job: True} if fail == "load" else {"fail_store": lambda job: job.request_id == "s"}
    drv, hbs = rig(store_latency=2, **engine)
    prefix = tokens(1, PREFIX)
    if fail == "load":
        warm(drv, hbs, prefix)
        drv.add([make_request("r", prefix + tokens(3, 40), 2, hbs)])
    else:
        drv.add([make_request("s", prefix, 2, hbs)])
    drain_checked(drv)
    if fail == "load":
        assert drv.side.counters.load_failures == 1
    else:
        assert drv.engine.stores_failed >= 1


def test_abort_mid_load_orphans_the_load_until_it_reports():
    drv, hbs = rig(hold_loads=True)
    prefix = tokens(1, PREFIX)
    warm(drv, hbs, prefix)
    drv.add([make_request("r", prefix + tokens(3, 40), 4, hbs)])
    step_until(drv, in_load("r"), max_steps=10)
    checked(drv, 2)
    job_id = drv.side.view().loads["r"].job.job_id
    assert abort(drv, "r")
    view = drv.side.view()
    assert "r" not in view.loads and list(view.orphan_loads) == [job_id]
    checked(drv, 2)
    drv.engine.release(drv.step_no)
    drain_checked(drv)


@pytest.mark.parametrize("hold", ["loads", "stores"])
def test_reset_retires_jobs_in_flight(hold):
    drv, hbs = rig(**{f"hold_{hold}": True})
    prefix = tokens(1, PREFIX)
    if hold == "loads":
        warm(drv, hbs, prefix)
        drv.add([make_request("r", prefix + tokens(3, 40), 4, hbs)])
        step_until(drv, in_load("r"), max_steps=10)
    else:
        drv.add([make_request("s", prefix, 4, hbs)])
        step_until(drv, lambda d: d.side.view().store_jobs, max_steps=20)
    checked(drv, 1)
    before = drv.side.view()
    assert drv.side.reset_cache()
    drv.side.check()
    after = drv.side.view()
    assert after.retired_loads == frozenset(ld.job.job_id for ld in before.load_jobs())
    assert set(after.retired_store_slots) == set(before.store_jobs)
    assert not after.store_event_jobs
    checked(drv, 3)
    drv.engine.release(drv.step_no)
    drain_checked(drv)
    assert drv.side.tier.stats().retired_slots == 0


def test_check_catches_a_broken_book():
    drv, hbs = rig(hold_stores=True)
    drv.add([make_request("s", tokens(7, 200), 2, hbs)])
    step_until(drv, lambda d: d.side.view().store_jobs, max_steps=20)
    drv.side.check()
    jobs = drv.side.jobs
    bid, readers = next(iter(jobs.block_readers.items()))
    jobs.block_readers[bid] = readers | {10_000}
    with pytest.raises(AssertionError, match="block readers"):
        jobs.check()
    jobs.block_readers[bid] = readers
    state = drv.side.admission.requests["s"]  # the scheduler's own per-request states
    state.pending_stores.add(10_000)
    with pytest.raises(AssertionError):
        drv.side.check()
    state.pending_stores.discard(10_000)
    drv.side.check()


def test_view_is_a_read_only_copy():
    drv, hbs = rig(hold_stores=True)
    drv.add([make_request("s", tokens(7, 200), 2, hbs)])
    step_until(drv, lambda d: d.side.view().store_jobs, max_steps=20)
    view = drv.side.view()
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.step = 0  # type: ignore[misc]
    with pytest.raises(TypeError):
        view.store_jobs[0] = None  # type: ignore[index]
    job_id = next(iter(view.store_jobs))
    drv.engine.release(drv.step_no)
    drain(drv)
    assert job_id in view.store_jobs and job_id not in drv.side.view().store_jobs


def test_admissions_are_recorded_only_when_asked():
    drv, hbs = rig()
    assert drv.side.admissions is not None  # the simulation driver asks by default
    kvt = connector_config("exact", 4096 * SLOT_BYTES)
    sched, _ = build_custom(GROUPS, num_blocks=160, max_num_batched_tokens=64, max_model_len=2048,
                            kv_transfer_config=kvt)
    quiet = SchedulerDriver(sched, TagCopier(), record_admissions=False)
    assert quiet.side.admissions is None
    prefix = tokens(1, PREFIX)
    for d in (drv, quiet):
        warm(d, hbs, prefix)
        d.add([make_request("r", prefix + tokens(3, 40), 2, hbs)])
        drain(d)
        assert d.side.counters.loads_admitted == 1
    assert [a.request_id for a in drv.side.admissions] == ["r"] and quiet.side.admissions is None
    assert drv.side.record_admissions() is drv.side.admissions  # asking again keeps the log


@pytest.mark.parametrize("reports", [("done", "failed"), ("failed", "done"), ("done", "done")])
def test_a_store_lands_only_when_every_worker_reports_it_done(reports):
    """With two workers (TP=2, or two PP stages) each reports every store job: one failed report drops the job's
    entries whichever worker reports first, so no tier entry is held by only some workers; a report after the job
    is over changes nothing."""
    from offload_connector.metadata import TransferJob
    from offload_connector.scheduler.events import TierEvents
    from offload_connector.transfer_jobs import SHARED, TierRead
    from offload_connector.scheduler.jobs import JobBook
    from offload_connector.scheduler.tier_index import TierIndex

    tier = TierIndex(8, [100])
    book = JobBook(tier, TierEvents(False, []), reporters=2)
    keys = [(0, "a"), (0, "b")]
    slots = [slot for _, slot in tier.begin_store(keys)]
    job = TransferJob(book.new_job_id(), "r", ((3, 4),), (tuple(slots),))
    book.add_store(job, keys, None)
    assert book.take_step()[1] == (job,)  # handed to the workers
    first, second = (r == "done" for r in reports)
    assert book.finish_store(job.job_id, first) == (None if first else "r")
    assert book.finish_store(job.job_id, second) == ("r" if first else None)
    book.check()
    assert not book.store_jobs and not book.block_readers
    landed = first and second
    assert [tier.is_ready(k) if tier.has(k) else None for k in keys] == ([True, True] if landed else [None, None])
    assert tier.used_slots() == (2 if landed else 0)


@pytest.mark.parametrize("settled_first", [False, True])
def test_an_abandoned_read_back_holds_its_slots_until_it_returns(settled_first):
    """A load whose read-back a worker abandoned at load_timeout_s fails; the CPU-tier slots the late read may still
    write leave the index but stay taken (no store gets them) until the worker reports the read returned. A read
    that returned before the failure reached the scheduler holds nothing."""
    from offload_connector.metadata import TransferJob
    from offload_connector.scheduler.events import TierEvents
    from offload_connector.transfer_jobs import SHARED, TierRead
    from offload_connector.scheduler.jobs import JobBook
    from offload_connector.scheduler.tier_index import TierIndex
    tier = TierIndex(3, [10])
    book = JobBook(tier, TierEvents(False, []), reporters=1)
    keys = [(0, b"a"), (0, b"b")]
    slots = [s for _, s in tier.begin_store(keys)]  # reserved for the read-back (being written, not readable)
    job = TransferJob.from_columns(book.new_job_id(), "r", 1, [0, 0], [5, 6], slots,
                                   reads=(TierRead(SHARED, tuple(keys), tuple(slots)),))
    book.add_load(job, keys, 32, promoted=keys)
    book.reads_abandoned([job.job_id])
    if settled_first:
        book.reads_settled([job.job_id])
    book.finish_load("r", ok=False)
    assert not any(tier.has(k) for k in keys)
    if settled_first:
        assert tier.stats().retired_slots == 0 and not book.held_read_slots
        assert len(tier.begin_store([(0, b"x"), (0, b"y"), (0, b"z")])) == 3
        return
    assert tier.stats().retired_slots == 2 and book.held_read_slots == {job.job_id: tuple(slots)}
    got = tier.begin_store([(0, b"x"), (0, b"y"), (0, b"z")])
    assert len(got) == 1 and got[0][1] not in slots  # the third slot only
    book.reads_settled([job.job_id])
    assert tier.stats().retired_slots == 0 and not book.held_read_slots and not book.abandoned_reads
    assert sorted(s for _, s in tier.begin_store([(0, b"y"), (0, b"z")])) == sorted(slots)
