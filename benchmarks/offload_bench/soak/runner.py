"""One soak run: our connector (`reservation: "exact"`, `kv_load_failure_policy: "recompute"`) on vLLM's real
scheduler in simulated time (replay's engine, time model and prompt building), with faults injected at random:

- load failures: a load job fails with probability `load_failure_rate` (writes nothing, reported in
  `failed_recving`; vLLM recomputes), store failures likewise with `store_failure_rate`;
- aborts: a request is aborted, with probability `abort_rate`, at a uniform time in its first `abort_window_s`
  simulated seconds (queued, loading, prefilling, decoding, or already gone); and an admitted load is aborted while
  its copy is in flight with probability `abort_loading_rate`;
- preemption: vLLM's own (a GPU pool small for the load), plus a running request forcibly preempted with
  probability `preempt_rate` per step, as `sim.faults.preempt` does;
- a CPU tier of a few requests' worth of blocks, which evicts all the time.

After every step: `sim.faults.step_invariants` (tier pins / host slots / store and load jobs / block readers
consistent, every readable entry holds its own tokens), and every load admitted in that step took from vLLM's pool
exactly what the ledger predicted (free_before - free_after == sum(plan.now), per-group entries and live blocks
equal); landed loads are content-checked by the driver (tags moved by the simulated copy backend under the real
worker). A stall is `stall_steps` consecutive steps that schedule nothing while requests wait and nothing is in
flight. At the end, after draining:
`sim.faults.drained_invariants` (GPU pool back to num_blocks - 1 free, no block referenced, no tier pin, no
bookkeeping left): each problem found counts as a leak.
"""

from __future__ import annotations

import heapq
import logging
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from offload_bench.replay.connectors import EngineSettings, ReplayEngine
from offload_bench.replay.engines import ClockTiming
from offload_bench.replay.timemodel import SimClock, TimeModel
from offload_bench.sim.tagcopy import TagCopier


@dataclass(frozen=True, kw_only=True)
class SoakConfig(EngineSettings):
    sim_seconds: float
    time_model: TimeModel
    seed: int = 0
    abort_rate: float = 0.05
    abort_window_s: float = 3.0
    abort_loading_rate: float = 0.1
    load_failure_rate: float = 0.1
    store_failure_rate: float = 0.02
    preempt_rate: float = 0.002
    stall_steps: int = 200
    max_drain_steps: int = 200_000
    check_every: int = 1  # run the step invariants every N steps (1: every step)

    def __post_init__(self) -> None:
        for name in ("abort_rate", "abort_loading_rate", "load_failure_rate", "store_failure_rate", "preempt_rate"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1] (got {v})")
        if self.sim_seconds <= 0:
            raise ValueError(f"sim_seconds must be > 0 (got {self.sim_seconds})")


@dataclass
class SoakResult:
    model: str
    vllm: str
    seed: int
    simulated_seconds: float = 0.0
    steps: int = 0
    requests: int = 0
    completed: int = 0
    aborted: int = 0
    aborted_mid_load: int = 0
    loads: int = 0
    loaded_tokens: int = 0
    load_failures_injected: int = 0
    store_failures_injected: int = 0
    stores_done: int = 0
    preemptions_forced: int = 0
    preemptions_by_vllm: int = 0
    evictions: int = 0
    store_rejections: int = 0
    deferrals: int = 0
    deferral_timeouts: int = 0
    held_for_older: int = 0
    cpu_hit_tokens: int = 0  # tokens the tier could serve at each request's first lookup with a hit
    aged_out_tokens: int = 0  # of those, given up after max_deferral_steps and recomputed
    admissions_checked: int = 0
    loads_content_checked: int = 0
    invariant_checks: int = 0
    invariant_violations: int = 0
    leaks: int = 0
    stalls: int = 0
    wall_seconds: float = 0.0
    stopped_reason: str = "drained"
    problems: list[str] = field(default_factory=list)  # the first few violations / leaks, verbatim
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.invariant_violations == 0 and self.leaks == 0 and self.stalls == 0 and \
            self.stopped_reason == "drained"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok, "simulated_hours": self.simulated_seconds / 3600}


class SoakEngine(ReplayEngine):
    """ReplayEngine for our connector, built with `kv_load_failure_policy: "recompute"`, its real worker over the
    bandwidth-timed simulated copy backend with injected store / load failures."""

    def __init__(self, settings: EngineSettings, clock: SimClock, fault_rng: random.Random,
                 load_failure_rate: float, store_failure_rate: float) -> None:
        from offload_bench.sim.driver import SchedulerDriver
        from offload_bench.sim.scenarios import connector_config

        kt = connector_config("exact", settings.cpu_bytes)
        kt.kv_load_failure_policy = "recompute"
        self._build("offload", settings, clock, kt)
        timing = ClockTiming(clock, self.block_bytes)
        eng = TagCopier(timing=timing, fail_store=lambda job: fault_rng.random() < store_failure_rate,
                        fail_load=lambda job: fault_rng.random() < load_failure_rate,
                        log_jobs=False)  # not every job of an hour
        self.engine = eng
        self.tally = timing.tally
        self.driver = SchedulerDriver(self.sched, eng, check_loads=settings.check_loads)
        self._instrument()

    def step(self) -> Any:
        # As ReplayEngine.step, without the per-group live-block scan (no plots here).
        rec = self.driver.step()
        self.recorder.on_step(self.clock.now, rec.free_blocks, rec.running, rec.waiting, [])
        return rec


def check_admissions(side: Any) -> tuple[int, list[str]]:
    """Loads admitted since the last call: what vLLM's allocation took against the ledger's plan. Consumes them."""
    problems: list[str] = []
    n = 0
    while side.admissions:
        adm = side.admissions.popleft()
        if adm.free_after is None:
            continue  # vLLM refused the allocation after our verdict; nothing was taken
        n += 1
        if adm.free_before - adm.free_after != sum(adm.plan.now):
            problems.append(f"{adm.request_id} (step {adm.step}): took {adm.free_before - adm.free_after} blocks, "
                            f"ledger predicted {sum(adm.plan.now)} {adm.plan.now}")
        if adm.entries_after != adm.plan.entries or adm.live_after != adm.plan.live:
            problems.append(f"{adm.request_id} (step {adm.step}): per-group entries/live {adm.entries_after}/"
                            f"{adm.live_after}, ledger predicted {adm.plan.entries}/{adm.plan.live}")
    return n, problems


Progress = Callable[[float, dict[str, Any]], None]  # simulated seconds, status


def run_soak(cfg: SoakConfig, progress: Progress | None = None) -> SoakResult:
    # The worker warns about every copy that failed; here failures are injected by the hundred: keep its errors only.
    log = logging.getLogger("vllm.offload_connector.worker.transfers")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        return _run_soak(cfg, progress)
    finally:
        log.setLevel(level)


def _run_soak(cfg: SoakConfig, progress: Progress | None) -> SoakResult:
    import vllm

    from offload_bench.replay.trace import PromptBuilder, clip_to_model
    from offload_bench.sim.driver import LoadContentError
    from offload_bench.sim.faults import abort, drained_invariants, preempt, step_invariants
    from offload_bench.sim.requests import make_request
    from offload_bench.soak.workload import soak_records

    res = SoakResult(cfg.model, vllm.__version__, cfg.seed,
                     settings={k: v for k, v in asdict(cfg).items() if k != "time_model"}
                     | {"time_model": cfg.time_model.describe()})
    records = soak_records(cfg.model, cfg.sim_seconds, cfg.seed)
    clock = SimClock(cfg.time_model)
    fault_rng = random.Random(cfg.seed ^ 0xFA11)
    eng = SoakEngine(cfg, clock, fault_rng, cfg.load_failure_rate, cfg.store_failure_rate)
    drv, side, sched, engine = eng.driver, eng.side, eng.sched, eng.engine
    res.settings["num_blocks"] = sched.kv_cache_config.num_blocks
    res.settings["cpu_tier_slots"] = side.tier.capacity_slots
    res.settings["groups"] = eng.group_names
    rng = random.Random(cfg.seed ^ 0xAB0E7)

    preempt_calls = {"n": 0}
    real_preempt = sched._preempt_request

    def counting_preempt(*a: Any, **kw: Any) -> Any:
        preempt_calls["n"] += 1
        return real_preempt(*a, **kw)

    sched._preempt_request = counting_preempt  # every preemption, vLLM's own and the forced ones

    prompts = PromptBuilder(cfg.seed)
    t0_ms = records[0].timestamp_ms if records else 0.0
    arrivals = [((r.timestamp_ms - t0_ms) * 1e-3, r) for r in records]
    aborts_due: list[tuple[float, str]] = []  # heap of (simulated time, request id)
    aborted: set[str] = set()
    loads_seen: set[str] = set()
    nxt = 0
    idle_run = 0
    wall0 = time.time()
    last_report = 0.0

    def fail(kind: str, problems: list[str]) -> None:
        res.invariant_violations += len(problems)
        res.problems.extend(f"step {drv.step_no} ({kind}): {p}" for p in problems[: 20 - len(res.problems)])

    while True:
        while nxt < len(arrivals) and arrivals[nxt][0] <= clock.now:
            _, rec = arrivals[nxt]
            c = clip_to_model(rec, cfg.max_model_len)
            rid = f"r{nxt}"
            eng.add(make_request(rid, prompts.build(rec, c.input_length, c.output_length), c.output_length,
                                 eng.sim.hash_block_size))
            res.requests += 1
            if rng.random() < cfg.abort_rate:
                heapq.heappush(aborts_due, (clock.now + rng.uniform(0.0, cfg.abort_window_s), rid))
            nxt += 1
        if not drv.busy():
            if nxt >= len(arrivals):
                break
            t_idle = clock.now
            clock.advance_to(arrivals[nxt][0])
            eng.recorder.on_idle(t_idle, clock.now, drv.pool.get_num_free_blocks())
            continue
        if drv.step_no >= cfg.max_drain_steps and nxt >= len(arrivals) and clock.now > cfg.sim_seconds * 4:
            res.stopped_reason = "not drained"
            break
        # ---- faults for this step
        while aborts_due and aborts_due[0][0] <= clock.now:
            _, rid = heapq.heappop(aborts_due)
            if rid in sched.requests and abort(drv, rid):
                res.aborted += 1
                aborted.add(rid)
        loading = side.view().loads
        for rid in loading:
            if rid in loads_seen:
                continue
            loads_seen.add(rid)
            if rng.random() < cfg.abort_loading_rate and rid in sched.requests and abort(drv, rid):
                res.aborted += 1
                res.aborted_mid_load += 1
                aborted.add(rid)
        if len(loads_seen) > 10_000:
            loads_seen &= set(side.view().loads)
        if sched.running and rng.random() < cfg.preempt_rate:
            res.preemptions_forced += preempt(drv, rng.choice(list(sched.running)).request_id)
        # ---- the step, then the checks
        try:
            obs = eng.step()
        except LoadContentError as err:
            fail("load contents", [str(err)])
            res.stopped_reason = "load content mismatch"
            break
        n, problems = check_admissions(side)
        res.admissions_checked += n
        if cfg.check_every <= 1 or drv.step_no % cfg.check_every == 0:
            problems += step_invariants(drv)
            res.invariant_checks += 1
        if problems:
            fail("invariants", problems)
            res.stopped_reason = "invariant violated"
            break
        idle_run = idle_run + 1 if obs.idle_while_waiting else 0
        if idle_run == cfg.stall_steps:
            res.stalls += 1
            res.problems.append(f"stall from step {drv.step_no - cfg.stall_steps + 1}")
        if idle_run >= 5 * cfg.stall_steps:
            res.stopped_reason = "stalled"
            break
        if progress is not None and time.time() - last_report > 0.5:
            last_report = time.time()
            progress(clock.now, {"step": drv.step_no, "run": obs.running, "wait": obs.waiting,
                                 "done": len(drv.finished), "aborted": res.aborted,
                                 "lf": engine.loads_failed, "pre": preempt_calls["n"]})
    if res.stopped_reason == "drained":
        leaks = drained_invariants(drv)
        res.leaks = len(leaks)
        res.problems.extend(f"leak: {p}" for p in leaks[:20])
    res.wall_seconds = round(time.time() - wall0, 1)
    res.simulated_seconds = clock.now
    res.steps = drv.step_no
    res.completed = len(drv.finished - aborted)
    res.loads = side.counters.loads_admitted
    res.loaded_tokens = side.counters.loaded_tokens
    res.load_failures_injected = engine.loads_failed
    res.store_failures_injected = engine.stores_failed
    res.stores_done = engine.stores_done
    res.preemptions_by_vllm = preempt_calls["n"] - res.preemptions_forced
    res.evictions = side.tier.evictions
    res.store_rejections = side.tier.store_rejections
    res.deferrals = side.counters.deferrals
    res.deferral_timeouts = side.counters.deferral_timeouts
    res.held_for_older = side.counters.held_for_older
    res.cpu_hit_tokens = side.counters.cpu_hit_tokens
    res.aged_out_tokens = side.counters.aged_out_tokens
    res.loads_content_checked = engine.loads_done
    if progress is not None:
        progress(clock.now, {"step": drv.step_no, "finished": True})
    return res


SUMMARY_ROWS = (
    ("simulated hours", lambda r: f"{r.simulated_seconds / 3600:.2f} ({r.simulated_seconds:,.0f} s)"),
    ("engine steps", lambda r: f"{r.steps:,}"),
    ("requests (completed / aborted)", lambda r: f"{r.requests:,} ({r.completed:,} / {r.aborted:,})"),
    ("aborted while loading", lambda r: f"{r.aborted_mid_load:,}"),
    ("loads admitted (tokens)", lambda r: f"{r.loads:,} ({r.loaded_tokens:,})"),
    ("admissions checked vs vLLM alloc", lambda r: f"{r.admissions_checked:,}"),
    ("loads content-checked", lambda r: f"{r.loads_content_checked:,}"),
    ("injected load failures", lambda r: f"{r.load_failures_injected:,}"),
    ("injected store failures",
     lambda r: f"{r.store_failures_injected:,} (of {r.stores_done + r.store_failures_injected:,} stores)"),
    ("preemptions (vLLM / forced)", lambda r: f"{r.preemptions_by_vllm:,} / {r.preemptions_forced:,}"),
    ("CPU tier evictions (rejected stores)", lambda r: f"{r.evictions:,} ({r.store_rejections:,})"),
    ("admission deferrals (timeouts)", lambda r: f"{r.deferrals:,} ({r.deferral_timeouts:,})"),
    ("requests held behind an older load", lambda r: f"{r.held_for_older:,}"),
    ("CPU-hit tokens (aged out)", lambda r: f"{r.cpu_hit_tokens:,} ({r.aged_out_tokens:,}, "
                                            f"{100 * r.aged_out_tokens / max(r.cpu_hit_tokens, 1):.1f}%)"),
    ("invariant checks", lambda r: f"{r.invariant_checks:,}"),
    ("invariant violations", lambda r: f"{r.invariant_violations}"),
    ("leaks at the end", lambda r: f"{r.leaks}"),
    ("stalls", lambda r: f"{r.stalls}"),
    ("stopped", lambda r: r.stopped_reason),
    ("wall time", lambda r: f"{r.wall_seconds:,.0f} s"),
)


def render_summary(results: list[SoakResult]) -> str:
    names = ["metric"] + [r.model for r in results]
    rows = [[label] + [fmt(r) for r in results] for label, fmt in SUMMARY_ROWS]
    widths = [max(len(names[i]), *(len(row[i]) for row in rows)) for i in range(len(names))]
    lines = ["  ".join(n.ljust(w) for n, w in zip(names, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)
