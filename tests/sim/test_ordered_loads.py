"""load_completion "ordered": a load is reported to vLLM before its copy lands, when it should land by the time the
forward pass that reads it starts, and that forward (named by the scheduler in `load_fences`) and every later copy
are ordered after the copy.

Three levels: the landing estimate alone; the transfer engine over a copier whose copies land when the test says;
and vLLM's real scheduler with the real worker over tag-checked simulated copies that land three steps after they
are issued, where the loaded request runs a step sooner than with "landed", its blocks hold the right tokens when it
does, and without the scheduler's fences the driver catches the forward reading a load still in flight.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from offload_connector.metadata import TransferJob
from offload_connector.worker.landing import LandingEstimate
from offload_connector.worker.transfers import TransferEngine


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


# ------------------------------------------------------------------------------------------- the estimate
def test_nothing_is_reported_early_before_a_load_has_landed():
    clock = Clock()
    est = LandingEstimate(clock)
    est.submitted(1, 10**9)
    for t in (0.015, 0.030, 0.045):
        clock.t = t
        est.poll()
        assert not est.lands_in_time(1)  # no rate known yet


def test_a_load_is_reported_when_it_lands_in_time_behind_the_loads_before_it():
    clock = Clock()
    est = LandingEstimate(clock)
    est.submitted(1, 10**9)
    for t in (0.015, 0.030):
        clock.t = t
        est.poll()
    est.landed(1, seconds=0.02)  # 50 GB/s measured on the device
    assert est.bytes_per_s == pytest.approx(5e10)
    assert est.step_s == pytest.approx(0.015)
    est.submitted(2, 10**9)  # 20 ms: lands at 0.05
    est.submitted(3, 10**9)  # behind it: 0.07
    clock.t = 0.045
    est.poll()
    assert est.lands_in_time(2)  # 0.05 <= 0.045 + 0.015
    assert not est.lands_in_time(3)  # 0.07 > 0.06
    clock.t = 0.060
    est.poll()
    assert est.lands_in_time(3)


def test_the_step_time_ignores_one_jump_over_an_idle_stretch():
    clock = Clock()
    est = LandingEstimate(clock)
    for t in (0.015, 0.030, 0.045, 2.0, 2.015, 2.030):
        clock.t = t
        est.poll()
    assert est.step_s == pytest.approx(0.015)


def test_the_horizon_is_the_time_from_a_report_to_the_forward_that_first_fences_it():
    # Pipeline parallel with several batches in flight: three 8 ms forwards, then a step that schedules nothing and
    # waits for the queued batches, whose outputs the worker polls at one instant. Polls come 25 ms apart, but a load
    # reported at such a poll is fenced by the forward 1 ms later: the horizon is that 1 ms, not the 25.
    clock = Clock()
    est = LandingEstimate(clock)
    est.submitted(1, 10**9)
    t, job = 0.0, 100
    for _ in range(8):
        t += 0.024
        clock.t = t
        for _ in range(4):
            est.poll()
        est.reported(job)  # some load reported at this burst
        t += 0.001
        clock.t = t
        est.fenced([job, 99999])  # the next forward is the first the scheduler ran it in (an unknown id is ignored)
        job += 1
    est.landed(1, seconds=0.02)  # 50 GB/s
    assert est.step_s == pytest.approx(0.025)
    assert est.horizon_s == pytest.approx(0.001)
    est.submitted(2, 10**9)  # lands 20 ms on
    clock.t = t + 0.016
    est.poll()  # 4 ms before it lands: within the 25 ms between polls, not by the forward that would read it
    assert not est.lands_in_time(2)
    clock.t = t + 0.0195
    est.poll()
    assert est.lands_in_time(2)  # 0.5 ms before: by then


def test_until_a_reported_load_is_fenced_the_step_time_is_the_horizon():
    clock = Clock()
    est = LandingEstimate(clock)
    for t in (0.015, 0.030, 0.045):
        clock.t = t
        est.poll()
        est.reported(int(t * 1000))  # never fenced (say, their requests were aborted)
    assert est.horizon_s == est.step_s == pytest.approx(0.015)
    est.fenced([15])  # now, at 0.045: 30 ms after the poll that reported it
    assert est.horizon_s == pytest.approx(0.030)
    for j in range(2000):  # reported loads no fence ever names are not kept without bound
        est.reported(10_000 + j)
    assert len(est._reported) <= 1024


def test_without_device_timing_the_rate_errs_low():
    clock = Clock()
    est = LandingEstimate(clock)
    est.submitted(1, 10**9)
    clock.t = 0.030
    est.poll()
    est.landed(1)  # seen landed at 30 ms, whenever it really did
    assert est.bytes_per_s == pytest.approx(10**9 / 0.030)


# ------------------------------------------------------------------------------------------- the transfer engine
class FakeCompletion:
    def __init__(self, seconds: float) -> None:
        self.landed = False
        self.seconds = seconds
        self.waits = 0
        self.ordered_before = 0
        self.error = None

    def query(self) -> bool:
        return self.landed

    def wait(self) -> None:
        self.waits += 1

    def order_before(self, stream: Any) -> None:
        self.ordered_before += 1

    def device_seconds(self) -> float:
        return self.seconds


class FakeCopier:
    """Copies that land when the test sets `landed`."""

    def __init__(self) -> None:
        self.issued: list[tuple[str, FakeCompletion]] = []

    def copy(self, direction: str, ids: Any, stream: Any = None) -> FakeCompletion:
        c = FakeCompletion(0.02)
        self.issued.append((direction, c))
        return c


def _job(job_id: int, block: int) -> TransferJob:
    return TransferJob(job_id, f"r{job_id}", ((block,),), ((block,),))


def _engine(ordered: bool) -> tuple[TransferEngine, FakeCopier, Clock]:
    clock = Clock()
    copier = FakeCopier()
    engine = TransferEngine(copier, 1, [10**9], torch.device("cpu"), ordered_loads=ordered, clock=clock)
    return engine, copier, clock


def _warm(engine: TransferEngine, copier: FakeCopier, clock: Clock) -> None:
    """One load that lands after two 15 ms steps: the engine learns the link (50 GB/s) and the step."""
    engine.submit_load(_job(1, 0))
    for t in (0.015, 0.030):
        clock.t = t
        assert engine.poll() == []
    copier.issued[-1][1].landed = True
    clock.t = 0.045
    assert [r.ok for r in engine.poll()] == [True]


def test_an_ordered_load_is_reported_before_it_lands_and_what_follows_is_ordered_after_it():
    engine, copier, clock = _engine(ordered=True)
    _warm(engine, copier, clock)
    engine.submit_load(_job(2, 1))  # issued at 45 ms, 20 ms on the link
    load = copier.issued[-1][1]
    clock.t = 0.060
    done = engine.poll()
    assert [(r.job.job_id, r.ok) for r in done] == [(2, True)] and not load.landed
    assert engine.pending() == 1  # still copying
    engine.submit_store(_job(3, 2))  # may reuse the host slot the load still reads
    assert load.ordered_before == 1
    engine.order_compute_after_loads(())  # not fenced yet: the forward does not wait
    assert load.waits == 0
    engine.order_compute_after_loads((2,))  # the scheduler names it: this forward waits (host wait off CUDA)
    assert load.waits == 1
    engine.order_compute_after_loads(())  # and every later one, until it lands
    assert load.waits == 2
    load.landed = True
    clock.t = 0.075
    engine.poll()
    engine.order_compute_after_loads(())
    assert load.waits == 2 and engine.pending() == 1  # only the store is left


def test_a_load_that_would_not_land_in_time_is_reported_once_landed():
    engine, copier, clock = _engine(ordered=True)
    _warm(engine, copier, clock)
    engine.submit_load(TransferJob(2, "r2", ((1, 2, 3),), ((1, 2, 3),)))  # 3 GB: 60 ms
    clock.t = 0.060
    assert engine.poll() == []
    clock.t = 0.075
    assert engine.poll() == []
    clock.t = 0.090
    assert [r.job.job_id for r in engine.poll()] == [2]  # 105 ms <= 90 + 15


def test_landed_mode_reports_only_landed_loads():
    engine, copier, clock = _engine(ordered=False)
    _warm(engine, copier, clock)
    engine.submit_load(_job(2, 1))
    for t in (0.060, 0.075, 0.090):
        clock.t = t
        assert engine.poll() == []
    copier.issued[-1][1].landed = True
    assert [r.job.job_id for r in engine.poll()] == [2]


def test_loads_checked_against_checksums_are_never_reported_before_they_land():
    engine = TransferEngine(FakeCopier(), 1, [10**9], torch.device("cpu"), ordered_loads=True,
                            checksums=object())  # type: ignore[arg-type]
    assert not engine._ordered_loads


# ------------------------------------------------------------------------------------------- vLLM's scheduler
GROUPS = (("full", 16, 0), ("sliding", 16, 128))
PREFIX = 2048


def _scene(load_completion: str) -> tuple[Any, dict[str, int]]:
    """Two prompts stored, the GPU prefix cache emptied, then both return one after the other; copies land three
    steps after they are issued. Returns the driver and each returning request's time to first token, in steps."""
    from offload_bench.sim.custom import build_custom
    from offload_bench.sim.driver import SchedulerDriver
    from offload_bench.sim.requests import make_request, tokens
    from offload_bench.sim.scenarios import connector_config
    from offload_bench.sim.tagcopy import TagCopier

    sched, hbs = build_custom(GROUPS, num_blocks=1200, max_num_batched_tokens=512, max_model_len=8192,
                              kv_transfer_config=connector_config("exact", 1 << 31, load_completion=load_completion))
    drv = SchedulerDriver(sched, TagCopier(3))
    early = []  # the worker's metric: loads it reported before they landed
    sink = drv.worker.stats
    record = sink.record_load_reported_early
    sink.record_load_reported_early = lambda: (early.append(1), record())[1]  # type: ignore[method-assign]
    drv.reported_early = early  # type: ignore[attr-defined]
    prompts = {name: tokens(seed, PREFIX) for name, seed in (("a", 1), ("b", 2))}
    for name, prompt in prompts.items():
        drv.add([make_request(f"warm-{name}", prompt, 1, hbs)])
        assert not drv.run().stalled
    sched.reset_prefix_cache()
    ttft: dict[str, int] = {}
    for name, prompt in prompts.items():
        rid = f"back-{name}"
        drv.add([make_request(rid, prompt + tokens(10, 40), 2, hbs)])
        added = drv.step_no
        while drv.busy():
            drv.step()
            req = sched.requests.get(rid)
            if rid not in ttft and (req is None or req.num_output_tokens > 0):
                ttft[rid] = drv.step_no - added
    return drv, ttft


def test_in_vllms_scheduler_an_ordered_load_runs_a_step_sooner_and_holds_its_tokens():
    landed, ttft_landed = _scene("landed")
    ordered, ttft_ordered = _scene("ordered")
    for drv in (landed, ordered):
        # Both returns were loaded, and the driver checked every loaded block's tokens once it had landed.
        assert drv.engine.loads_done == 2 and drv.engine.loads_failed == 0
        assert drv.side.counters.loaded_tokens >= 2 * (PREFIX - 128)
        assert drv.idle_invariant()
        assert not drv._unlanded  # the load reported before it landed was checked once it had
    # The first load teaches the worker the link and the step, so it is reported once landed in both modes; the
    # second is reported before it lands, and its request's first token comes at least a step sooner.
    assert ttft_ordered["back-a"] == ttft_landed["back-a"]
    assert ttft_ordered["back-b"] <= ttft_landed["back-b"] - 1
    assert len(ordered.reported_early) == 1 and not landed.reported_early  # vllm:..._loads_reported_early_total


def test_without_the_schedulers_fences_the_forward_reads_a_load_still_in_flight(monkeypatch: pytest.MonkeyPatch):
    from offload_bench.sim.driver import LoadContentError
    from offload_connector.scheduler import core

    real = core.OffloadScheduler.build_meta

    def no_fences(self: Any, scheduler_output: Any) -> Any:
        self._load_fences = []
        return real(self, scheduler_output)

    monkeypatch.setattr(core.OffloadScheduler, "build_meta", no_fences)
    with pytest.raises(LoadContentError, match="before its load was ordered"):
        _scene("ordered")
