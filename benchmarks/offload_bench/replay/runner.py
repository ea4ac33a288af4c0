"""Replay one workload through each connector in turn, in simulated time.

Per connector: a fresh real vLLM scheduler over the model's planned KV layout; requests are added when simulated
time reaches their (scaled) timestamp; each engine step advances time by the step-time model; an idle engine jumps
to the next arrival. A stall (K consecutive steps that schedule nothing while requests wait and no transfer is in
flight) ends that connector's run with a dump of who holds the pool; the other connectors still run.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from offload_bench.replay.connectors import CONNECTORS, EngineSettings, ReplayEngine
from offload_bench.replay.metrics import ConnectorResult
from offload_bench.replay.timemodel import SimClock, TimeModel
from offload_bench.replay.trace import PromptBuilder, TraceRecord, clip_to_model
from offload_bench.replay.workloads import Workload


@dataclass(frozen=True, kw_only=True)
class ReplayConfig(EngineSettings):
    connectors: tuple[str, ...]
    time_model: TimeModel
    seed: int = 0
    stall_steps: int = 200
    max_steps: int = 200_000
    limit: int | None = None  # replay only the first N requests (arrival order)
    time_scale: float = 1.0  # multiply trace timestamps (>1 spreads arrivals out)

    def __post_init__(self) -> None:
        bad = [c for c in self.connectors if c not in CONNECTORS]
        if bad or not self.connectors:
            raise ValueError(f"connectors {bad or '[]'} not known; choose from {', '.join(CONNECTORS)}")
        if self.time_scale <= 0:
            raise ValueError(f"time_scale must be > 0 (got {self.time_scale})")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1 (got {self.limit})")


@dataclass
class RunOutput:
    result: ConnectorResult
    series: dict[str, list[Any]]
    stall_time: float | None = None


@dataclass
class ReplayOutput:
    config: ReplayConfig
    workload: str
    requests: int
    clipped: int
    runs: list[RunOutput] = field(default_factory=list)
    phase_marks: list[tuple[float, str]] = field(default_factory=list)  # (simulated s, phase) for the plots

    def to_json(self) -> dict[str, Any]:
        import vllm

        cfg = asdict(self.config)
        return {"vllm": vllm.__version__, "workload": self.workload, "requests": self.requests,
                "clipped_requests": self.clipped, "config": cfg,
                "results": [r.result.to_json() for r in self.runs]}


Progress = Callable[[str, int, int, dict[str, Any]], None]  # connector, completed, total, status


def select(workload: Workload, cfg: Any) -> list[TraceRecord]:
    """The records a replay runs: the first `cfg.limit` (a ReplayConfig or a RouterConfig), or all."""
    recs = list(workload.records)
    return recs[: cfg.limit] if cfg.limit else recs


def run_connector(kind: str, records: Sequence[TraceRecord], cfg: ReplayConfig,
                  progress: Progress | None = None) -> RunOutput:
    clock = SimClock(cfg.time_model)
    # Building the scheduler is timed apart: the first build in a process also pays vLLM's model inspection.
    eng = ReplayEngine(kind, cfg, clock)
    wall0 = time.time()
    from offload_bench.sim.requests import hash_lookahead, make_request

    prompts = PromptBuilder(cfg.seed)
    t0 = records[0].timestamp_ms if records else 0.0
    arrivals = [((r.timestamp_ms - t0) * 1e-3 * cfg.time_scale, r) for r in records]
    nxt = 0
    idle_run = 0
    stall_step = None
    reason = "drained"
    total = len(records)
    last_report = 0.0
    while True:
        while nxt < total and arrivals[nxt][0] <= clock.now:
            t_arr, rec = arrivals[nxt]
            c = clip_to_model(rec, cfg.max_model_len)
            toks = prompts.build(rec, c.input_length, c.output_length)
            eng.add(make_request(f"r{nxt}", toks, c.output_length, eng.sim.hash_block_size,
                                 hash_lookahead_tokens=hash_lookahead(eng.sched)), record_phase(rec))
            nxt += 1
        if not eng.busy():
            if nxt >= total:
                break
            t_idle = clock.now
            clock.advance_to(arrivals[nxt][0])
            eng.recorder.on_idle(t_idle, clock.now, eng.driver.pool.get_num_free_blocks())
            continue
        if eng.step_no >= cfg.max_steps:
            reason = f"max_steps ({cfg.max_steps}) reached"
            break
        obs = eng.step()
        idle_run = idle_run + 1 if obs.idle_while_waiting else 0
        if idle_run >= cfg.stall_steps:
            stall_step = eng.step_no - cfg.stall_steps + 1
            reason = f"stalled: {cfg.stall_steps} steps with no token scheduled, requests waiting, nothing in flight"
            break
        if progress is not None and (time.time() - last_report > 0.5):
            last_report = time.time()
            progress(kind, eng.recorder_completed(), total,
                     {"step": eng.step_no, "t": clock.now, "run": obs.running, "wait": obs.waiting})
    if progress is not None:
        progress(kind, eng.recorder_completed(), total, {"step": eng.step_no, "t": clock.now, "done": True})
    return _finish(kind, eng, clock, total, stall_step, reason, time.time() - wall0)


def _finish(kind: str, eng: ReplayEngine, clock: SimClock, total: int, stall_step: int | None, reason: str,
            wall: float) -> RunOutput:
    from offload_bench.replay.pool_dump import pool_holders

    tier_bytes, tier_tokens = eng.tier_usage()
    res = result_from_summary(
        kind, eng.recorder.summary(), total=total, simulated_seconds=clock.now, steps=eng.step_no,
        stall_step=stall_step, tier_bytes=tier_bytes, tier_tokens=tier_tokens, loaded_bytes=eng.tally.load_bytes,
        stored_bytes=eng.tally.store_bytes, reason=reason, wall=wall,
        stall_dump=pool_holders(eng) if stall_step is not None else None,
        extra={"num_blocks": eng.sim.kv_cache_config.num_blocks, "groups": eng.group_names,
               # Simulated seconds forward passes waited for loads reported before they landed (ours, "ordered").
               "forward_wait_s": round(clock.forward_wait_s, 6),
               "loads_content_checked": eng.loads_content_checked(),
               **_load_outcomes(eng), **_spec_outcomes(eng), **spare_usage(eng),
               # Which groups' admission count sim/vllm_patched.py replaced (vllm-offloading-patched only).
               **({"admission_fix_groups": list(eng.patched_groups)} if eng.patched_groups else {})})
    return RunOutput(res, eng.recorder.series(), clock.now if stall_step is not None else None)


def result_from_summary(connector: str, s: dict[str, Any], *, total: int, simulated_seconds: float, steps: int,
                        stall_step: int | None, tier_bytes: int | None, tier_tokens: int | None, loaded_bytes: int,
                        stored_bytes: int, reason: str, wall: float, stall_dump: Any, extra: dict[str, Any],
                        tokens_loaded_from_cpu: int | None = None) -> ConnectorResult:
    """One column's result from a `Recorder.summary()` and the run's own figures (the single-engine replay and the
    router replay both report through it). `tokens_loaded_from_cpu`: when not every loaded token came from a CPU
    tier (the router's shared tier), the part that did."""
    sim_s = simulated_seconds
    return ConnectorResult(
        connector=connector, stalled=stall_step is not None, first_stall_step=stall_step, requests_total=total,
        requests_completed=s["requests_completed"], simulated_seconds=sim_s, steps=steps,
        output_tokens=s["output_tokens"], output_tokens_per_s=s["output_tokens"] / sim_s if sim_s > 0 else 0.0,
        ttft_p50_s=s["ttft_p50_s"], ttft_p95_s=s["ttft_p95_s"],
        tokens_loaded_from_cpu=(s["tokens_loaded_from_cpu"] if tokens_loaded_from_cpu is None
                                else tokens_loaded_from_cpu),
        tokens_recomputed=s["tokens_recomputed"],
        recomputed_tokens_in_cpu=s["recomputed_tokens_in_cpu"], recomputed_restorable=s["recomputed_restorable"],
        prompt_tokens_computed=s["prompt_tokens_computed"],
        gpu_pool_util_mean=s["gpu_pool_util_mean"], gpu_pool_util_p95=s["gpu_pool_util_p95"],
        gpu_pool_util_per_group=s["gpu_pool_util_per_group"], admission_deferrals=s["admission_deferrals"],
        cpu_tier_bytes=tier_bytes, cpu_tier_cached_tokens=tier_tokens,
        cpu_tier_bytes_per_cached_token=(tier_bytes / tier_tokens) if tier_bytes and tier_tokens else None,
        transfer_bytes_loaded=loaded_bytes, transfer_bytes_stored=stored_bytes,
        stopped_reason=reason, wall_seconds=round(wall, 1), stall_dump=stall_dump,
        extra={**extra, **_to_last_token(s, stall_step), **_without_spare(tier_bytes, tier_tokens, extra)},
        per_phase=s.get("per_phase") or {})


def _spec_outcomes(eng: ReplayEngine) -> dict[str, int]:
    """Batches the driver kept in flight, and under speculative decoding the drafts scheduled and accepted."""
    drv = eng.driver
    out = {"batches_in_flight": int(getattr(drv, "batch_depth", 1))}
    if getattr(eng.sched, "num_spec_tokens", 0):
        out.update(drafts_scheduled=int(getattr(drv, "drafts_scheduled", 0)),
                   drafts_accepted=int(getattr(drv, "drafts_accepted", 0)))
    return out


def _load_outcomes(eng: ReplayEngine) -> dict[str, int]:
    """Our connector's account of the loads it could serve: tokens its tier could restore at each request's first
    lookup with a hit, and those it gave up (aged out after max_deferral_steps, or too big for an idle pool)."""
    side = getattr(eng, "side", None)
    if side is None:
        return {}
    c = side.counters
    return {"cpu_hit_tokens": c.cpu_hit_tokens, "aged_out_tokens": c.aged_out_tokens,
            "too_big_tokens": c.too_big_tokens, "held_for_older": c.held_for_older,
            "held_behind_load": c.held_behind_load}


def _to_last_token(s: dict[str, Any], stall_step: int | None) -> dict[str, float]:
    """Output tokens per second from the first arrival to the last output token (as vLLM's serving benchmark times a
    run: until the last response), next to `output_tokens_per_s`, which runs to the end of the connector's work."""
    last = s.get("last_token_s")
    if stall_step is not None or not last or s["requests_completed"] == 0:
        return {}
    return {"last_token_s": last, "output_tokens_per_s_to_last_token": s["output_tokens"] / last}


def _without_spare(tier_bytes: int | None, tier_tokens: int | None, extra: dict[str, Any]) -> dict[str, float]:
    """Host bytes per cached token less the spare windows (`cpu_tier_spare_bytes`, ours only; a column without them
    counts none): what the tier keeps once it is full. The one place the figure is computed; the tables and the
    layout sweep read it from here."""
    if not tier_bytes or not tier_tokens:
        return {}
    return {"cpu_tier_bytes_per_cached_token_without_spare":
            (tier_bytes - extra.get("cpu_tier_spare_bytes", 0)) / tier_tokens}


def spare_usage(eng: ReplayEngine) -> dict[str, int]:
    """Host bytes our CPU tier gives to spare windows at the end of the run: room no regular entry used, which any
    regular store takes back first. The tier's bytes per cached token count them; without them is what the tier keeps
    when it is full (the store points' budget)."""
    side = getattr(eng, "side", None)
    if side is None:
        return {}
    return {"cpu_tier_spare_bytes": side.tier.stats().spare_entries * side.slot_bytes}


def run_replay(workload: Workload, cfg: ReplayConfig, progress: Progress | None = None) -> ReplayOutput:
    records = select(workload, cfg)
    clipped = sum(clip_to_model(r, cfg.max_model_len).clipped for r in records)
    out = ReplayOutput(cfg, workload.name, len(records), clipped, phase_marks=phase_marks(records, cfg.time_scale))
    for kind in cfg.connectors:
        out.runs.append(run_connector(kind, records, cfg, progress))
    return out


def record_phase(rec: TraceRecord) -> str:
    """The label a request's figures are grouped under: the record's string `phase` (every built-in workload sets
    one), else whether it is the first turn of a session or a later one (trace files with `session`/`turn`), else
    none."""
    phase = rec.get("phase")
    if isinstance(phase, str) and phase:
        return phase
    if rec.session is not None:
        return "later turn" if rec.turn else "first turn"
    return ""


def phase_marks(records: Sequence[TraceRecord], time_scale: float) -> list[tuple[float, str]]:
    """First arrival of each main phase of a built-in workload (warm-up, filler and background parts left out)."""
    if not records:
        return []
    t0 = records[0].timestamp_ms
    seen: dict[str, float] = {}
    for r in records:
        phase = r.get("phase")
        if isinstance(phase, str) and phase not in seen and not phase.endswith(("-warm", "-filler", "-background")):
            seen[phase] = (r.timestamp_ms - t0) * 1e-3 * time_scale
    return [(t, name) for name, t in seen.items()]
