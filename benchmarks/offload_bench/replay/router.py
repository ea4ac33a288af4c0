"""Several engines behind a round-robin router, with and without the shared tier (issue 13).

Each engine is what a single-engine replay runs for the `offload` column (connectors.ReplayEngine): a real vLLM
scheduler and KV cache manager over its own GPU pool, our connector's real scheduler side and real worker side
(`OffloadWorker`) over the simulated copier, its own CPU tier, its own simulated GPU timeline (`SimClock`). The
router hands request i (arrival order) to engine i mod N: no session affinity, so a returning session, or a request
sharing a prefix with an earlier one, lands on another engine than the one that computed the prefix most of the time.

Two columns, each a fresh set of N engines:
- `offload (private)`: every engine has only its private CPU tier; a prefix another engine computed is recomputed.
- `offload+shared`: the same engines, each also with the shared tier (`remote_store`), all over one simulated
  shared store (sim/remote.py): an engine loads what another engine wrote through. The store never evicts unless
  `shared_bytes` bounds it (--shared-bytes): it then evicts least-recently-used values, and a load whose shard was
  evicted under a live marker fails and is recomputed, as with a real store.

Both columns run on one simulated clock: at every turn the engine whose GPU timeline is furthest behind steps (an
idle engine jumps to its next arrival), so what one engine writes to the shared store at simulated time t is seen
by the others' lookups after t, to within one step. Recompute accounting is cluster-wide: a request's reusable
prefix is what any engine had computed when it arrived (metrics.Recorder, one `ever` set for all engines).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Sequence

from offload_bench.replay import MAX_ENGINES
from offload_bench.replay.connectors import EngineSettings, ReplayEngine
from offload_bench.replay.metrics import ConnectorResult, Recorder
from offload_bench.replay.runner import (RunOutput, phase_marks, record_phase, result_from_summary, select,
                                        spare_usage)
from offload_bench.replay.table import fmt, fmt_bytes
from offload_bench.replay.timemodel import SimClock, TimeModel
from offload_bench.replay.trace import PromptBuilder, TraceRecord, clip_to_model
from offload_bench.replay.workloads import Workload
from offload_bench.sim.remote import (DEFAULT_SHARED_BANDWIDTH_GBPS, DEFAULT_SHARED_LATENCY_MS, RemoteTiming, SimPool,
                                      SimWorkerRemoteTier, attach_sim_remote, sim_store_factory)
from offload_connector.transfer_jobs import SHARED as SHARED_TIER

ROUTERS = ("round-robin",)
PRIVATE, SHARED = "offload (private)", "offload+shared"
COLUMNS = (PRIVATE, SHARED)
# The shared column's connector config: the connector's own remote_store path (scheduler planner, worker reads and
# writes); the kind only names it, sim_store_factory opens the simulated store whatever the kind.
# The simulated store moves tags, not bytes, so there is nothing to authenticate: the column says so explicitly, as an
# operator must (remote_allow_unauthenticated); the MAC's cost is measured on real bytes (offload-connector mac-bench).
SHARED_EXTRA = (("remote_store", "redis"), ("remote_allow_unauthenticated", True))


@dataclass(frozen=True, kw_only=True)
class RouterConfig(EngineSettings):
    time_model: TimeModel
    engines: int = 2
    router: str = "round-robin"
    columns: tuple[str, ...] = COLUMNS
    shared_bandwidth_gbps: float = DEFAULT_SHARED_BANDWIDTH_GBPS
    shared_latency_ms: float = DEFAULT_SHARED_LATENCY_MS
    shared_bytes: int | None = None  # the shared store's capacity (LRU eviction); None: it never evicts
    seed: int = 0
    stall_steps: int = 200
    max_steps: int = 200_000  # per engine
    limit: int | None = None
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        if not 2 <= self.engines <= MAX_ENGINES:
            raise ValueError(f"engines must be 2 to {MAX_ENGINES} (got {self.engines})")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)} (got {self.router!r})")
        bad = [c for c in self.columns if c not in COLUMNS]
        if bad or not self.columns:
            raise ValueError(f"columns {bad or '[]'} not known; choose from {', '.join(COLUMNS)}")
        if not (self.shared_bandwidth_gbps > 0 and math.isfinite(self.shared_bandwidth_gbps)):
            raise ValueError(f"shared_bandwidth_gbps must be > 0 (got {self.shared_bandwidth_gbps})")
        if not (self.shared_latency_ms >= 0 and math.isfinite(self.shared_latency_ms)):
            raise ValueError(f"shared_latency_ms must be >= 0 (got {self.shared_latency_ms})")
        if self.shared_bytes is not None and (isinstance(self.shared_bytes, bool)
                                              or not isinstance(self.shared_bytes, int) or self.shared_bytes < 1):
            raise ValueError(f"shared_bytes must be an int >= 1, or None for an unbounded store (got "
                             f"{self.shared_bytes!r})")
        if self.time_scale <= 0:
            raise ValueError(f"time_scale must be > 0 (got {self.time_scale})")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1 (got {self.limit})")
        if any(k in (key for key, _ in SHARED_EXTRA) or k in ("remote_options", "remote_secret_file")
               for k, _ in self.offload_extra):
            raise ValueError("offload_extra must not set the shared tier's keys (remote_*: the shared column sets them)")


@dataclass
class RouterOutput:
    config: RouterConfig
    workload: str
    requests: int
    clipped: int
    runs: list[RunOutput] = field(default_factory=list)
    phase_marks: list[tuple[float, str]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        import vllm

        return {"vllm": vllm.__version__, "workload": self.workload, "requests": self.requests,
                "clipped_requests": self.clipped, "config": asdict(self.config),
                "results": [r.result.to_json() for r in self.runs]}


class RouterEngine:
    """One engine of a column: a `ReplayEngine("offload")`, with the shared tier over `pool` when given."""

    def __init__(self, index: int, cfg: RouterConfig, pool: SimPool | None) -> None:
        self.index = index
        self.clock = SimClock(cfg.time_model)
        self.remote: SimWorkerRemoteTier | None = None
        if pool is None:
            self.eng = ReplayEngine("offload", cfg, self.clock)
        else:
            base = {f.name: getattr(cfg, f.name) for f in fields(EngineSettings)}
            base["offload_extra"] = tuple(sorted({**dict(cfg.offload_extra), **dict(SHARED_EXTRA)}.items()))
            settings = EngineSettings(**base)
            with sim_store_factory(pool):  # the scheduler's marker client and the worker's shard client
                self.eng = ReplayEngine("offload", settings, self.clock)
            timing = RemoteTiming(self.clock, self.eng.block_bytes, cfg.shared_bandwidth_gbps, cfg.shared_latency_ms)
            self.remote = attach_sim_remote(self.eng.driver, timing)
        self.arrivals: list[tuple[float, str, TraceRecord]] = []
        self.next = 0
        self.idle_run = 0


def build_column(column: str, cfg: RouterConfig) -> tuple[list[RouterEngine], SimPool | None]:
    pool = SimPool(cfg.shared_bytes) if column == SHARED else None
    engines = [RouterEngine(i, cfg, pool) for i in range(cfg.engines)]
    ever = engines[0].eng.recorder.ever
    for e in engines[1:]:
        e.eng.recorder.ever = ever  # reusable = computed by any engine before the request arrived
    return engines, pool


Progress = Callable[[str, int, int, dict[str, Any]], None]


def run_column(column: str, records: Sequence[TraceRecord], cfg: RouterConfig,
               progress: Progress | None = None) -> RunOutput:
    from offload_bench.sim.requests import hash_lookahead, make_request

    engines, pool = build_column(column, cfg)
    wall0 = time.time()
    prompts = PromptBuilder(cfg.seed)
    t0 = records[0].timestamp_ms if records else 0.0
    for i, rec in enumerate(records):  # round robin by arrival
        engines[i % cfg.engines].arrivals.append(((rec.timestamp_ms - t0) * 1e-3 * cfg.time_scale, f"r{i}", rec))
    total = len(records)
    stall: tuple[RouterEngine, int] | None = None
    reason = "drained"
    last_report = 0.0

    def admit(e: RouterEngine) -> None:
        while e.next < len(e.arrivals) and e.arrivals[e.next][0] <= e.clock.now:
            _, rid, rec = e.arrivals[e.next]
            c = clip_to_model(rec, cfg.max_model_len)
            toks = prompts.build(rec, c.input_length, c.output_length)
            e.eng.add(make_request(rid, toks, c.output_length, e.eng.sim.hash_block_size,
                                   hash_lookahead_tokens=hash_lookahead(e.eng.sched)), record_phase(rec))
            e.next += 1

    def when(e: RouterEngine) -> float:
        admit(e)
        if e.eng.busy():
            return e.clock.now
        return e.arrivals[e.next][0] if e.next < len(e.arrivals) else math.inf

    while True:
        t, e = min(((when(x), x) for x in engines), key=lambda p: (p[0], p[1].index))
        if t == math.inf:
            break
        if not e.eng.busy():
            t_idle = e.clock.now
            e.clock.advance_to(t)
            e.eng.recorder.on_idle(t_idle, e.clock.now, e.eng.driver.pool.get_num_free_blocks())
            admit(e)
        if e.eng.step_no >= cfg.max_steps:
            reason = f"engine {e.index}: max_steps ({cfg.max_steps}) reached"
            break
        obs = e.eng.step()
        e.idle_run = e.idle_run + 1 if obs.idle_while_waiting else 0
        if e.idle_run >= cfg.stall_steps:
            stall = (e, e.eng.step_no - cfg.stall_steps + 1)
            reason = (f"engine {e.index} stalled: {cfg.stall_steps} steps with no token scheduled, requests waiting, "
                      f"nothing in flight")
            break
        if progress is not None and time.time() - last_report > 0.5:
            last_report = time.time()
            progress(column, sum(x.eng.recorder_completed() for x in engines), total,
                     {"step": sum(x.eng.step_no for x in engines), "t": min(x.clock.now for x in engines),
                      "run": sum(len(x.eng.sched.running) for x in engines),
                      "wait": sum(x.eng.waiting_count() for x in engines)})
    if progress is not None:
        progress(column, sum(x.eng.recorder_completed() for x in engines), total,
                 {"step": sum(x.eng.step_no for x in engines), "t": max(x.clock.now for x in engines), "done": True})
    return _finish(column, engines, pool, total, stall, reason, time.time() - wall0)


def _merged_recorder(engines: list[RouterEngine]) -> Recorder:
    first = engines[0].eng.recorder
    merged = Recorder(first.hbs, first.group_names, first.usable)
    for e in engines:
        r = e.eng.recorder
        merged.reqs.update(r.reqs)
        merged.deferrals += r.deferrals
        merged.loaded_tokens += r.loaded_tokens
        merged.output_tokens += r.output_tokens
        merged.completed += r.completed
        merged.used += r.used
        for g, v in enumerate(r.group_used):
            merged.group_used[g] += v
    return merged


def _finish(column: str, engines: list[RouterEngine], pool: SimPool | None, total: int,
            stall: tuple[RouterEngine, int] | None, reason: str, wall: float) -> RunOutput:
    from offload_bench.replay.pool_dump import pool_holders

    rec = _merged_recorder(engines)
    s = rec.summary()
    sim_s = max(e.clock.now for e in engines)
    remotes = [e.remote for e in engines if e.remote is not None]
    shared_tokens = sum(r.fetched_tokens for r in remotes)
    tier_bytes = tier_tokens = 0
    for e in engines:
        b, tk = e.eng.tier_usage()
        tier_bytes += b or 0
        tier_tokens += tk or 0
    sides = [e.eng.side for e in engines]
    extra: dict[str, Any] = {
        "engines": len(engines), "groups": engines[0].eng.group_names,
        "num_blocks": engines[0].eng.sim.kv_cache_config.num_blocks,
        "per_engine_completed": [e.eng.recorder.completed for e in engines],
        "per_engine_requests": [len(e.arrivals) for e in engines],
        "per_engine_steps": [e.eng.step_no for e in engines],
        "loads_content_checked": sum(e.eng.loads_content_checked() or 0 for e in engines),
        "tokens_loaded_total": s["tokens_loaded_from_cpu"],
        "tokens_loaded_from_shared": shared_tokens if remotes else None,
        "cpu_hit_tokens": sum(x.counters.cpu_hit_tokens for x in sides),
        "aged_out_tokens": sum(x.counters.aged_out_tokens for x in sides),
        "too_big_tokens": sum(x.counters.too_big_tokens for x in sides),
        "held_for_older": sum(x.counters.held_for_older for x in sides),
        "held_behind_load": sum(x.counters.held_behind_load for x in sides),
        "batches_in_flight": int(getattr(engines[0].eng.driver, "batch_depth", 1)),
        # Every engine's spare windows, so the bytes per cached token without them are the whole pool's.
        "cpu_tier_spare_bytes": sum(spare_usage(e.eng).get("cpu_tier_spare_bytes", 0) for e in engines),
        **_admission_check(sides),
    }
    if remotes:
        planners = [x.second_tiers[SHARED_TIER] for x in sides]
        extra.update(
            shared_blocks_written=sum(p.counters.writes_landed for p in planners),
            shared_write_skips=sum(p.counters.write_skips for p in planners),
            shared_write_failures=sum(p.counters.write_failures for p in planners),
            shared_lookups=sum(p.counters.lookups for p in planners),
            shared_blocks_fetched=sum(r.fetched_blocks for r in remotes),
            shared_fetches=sum(r.fetches for r in remotes),
            shared_fetch_failures=sum(r.fetch_failures for r in remotes),
            shared_loads_failed=sum(p.counters.fetch_failures for p in planners),  # recomputed; markers removed
            shared_put_tag_mismatches=sum(r.put_tag_mismatches for r in remotes),
            shared_bytes_put=sum(r.timing.put_bytes for r in remotes),
            shared_bytes_fetched=sum(r.timing.fetch_bytes for r in remotes),
            shared_link_busy_s=[round(r.timing.busy_seconds, 3) for r in remotes],
            **_store_figures(pool))
    res = result_from_summary(
        column, s, total=total, simulated_seconds=sim_s, steps=sum(e.eng.step_no for e in engines),
        stall_step=stall[1] if stall else None, tier_bytes=tier_bytes, tier_tokens=tier_tokens,
        loaded_bytes=sum(e.eng.tally.load_bytes for e in engines),
        stored_bytes=sum(e.eng.tally.store_bytes for e in engines), reason=reason, wall=wall,
        stall_dump=pool_holders(stall[0].eng) if stall is not None else None, extra=extra,
        tokens_loaded_from_cpu=s["tokens_loaded_from_cpu"] - shared_tokens)
    for e in engines:  # nothing of the worker sides is read after this
        if e.remote is not None:
            e.remote.close()
    return RunOutput(res, rec.series(), sim_s if stall is not None else None)


def run_router(workload: Workload, cfg: RouterConfig, progress: Progress | None = None) -> RouterOutput:
    records = select(workload, cfg)
    clipped = sum(clip_to_model(r, cfg.max_model_len).clipped for r in records)
    out = RouterOutput(cfg, workload.name, len(records), clipped, phase_marks=phase_marks(records, cfg.time_scale))
    for column in cfg.columns:
        out.runs.append(run_column(column, records, cfg, progress))
    return out


# ------------------------------------------------------------------------------------------------- the table
def _gib(v: float | None) -> str:
    return "-" if v is None else f"{v / 2**30:.1f} GiB"


def _store_figures(pool: SimPool | None) -> dict[str, Any]:
    """What the shared store held at the end and what a bounded one evicted (shard values at their blocks' bytes,
    markers at their own length)."""
    if pool is None:
        return {}
    return {"shared_store_values": len(pool.values), "shared_store_bytes": pool.used_bytes,
            "shared_store_capacity_bytes": pool.capacity_bytes, "shared_evictions": pool.evictions,
            "shared_evicted_bytes": pool.evicted_bytes, "shared_puts_refused": pool.refused}


def _admission_check(sides: Sequence[Any]) -> dict[str, int]:
    """Every recorded admission's predicted blocks against what vLLM allocated (as the ledger fuzz checks them):
    exact whichever tier the load reads from."""
    checked = mismatched = 0
    for side in sides:
        for adm in side.admissions or ():
            if adm.free_after is None:
                continue  # vLLM refused the allocation after our verdict: nothing was taken
            checked += 1
            if (adm.free_before - adm.free_after != sum(adm.plan.now) or adm.entries_after != adm.plan.entries
                    or adm.live_after != adm.plan.live):
                mismatched += 1
    return {"admissions_checked": checked, "admission_mismatches": mismatched}


ROWS: list[tuple[str, Callable[[ConnectorResult], Any], Callable[[Any], str]]] = [
    ("stalled", lambda r: r.stalled, str),
    ("requests completed/total", lambda r: f"{r.requests_completed}/{r.requests_total}", str),
    ("  per engine", lambda r: " + ".join(f"{c}/{n}" for c, n in zip(r.extra["per_engine_completed"],
                                                                     r.extra["per_engine_requests"])), str),
    ("simulated seconds", lambda r: r.simulated_seconds, fmt(",.1f")),
    ("output tokens / sim s", lambda r: r.output_tokens_per_s, fmt(",.1f")),
    ("TTFT p50 (s)", lambda r: r.ttft_p50_s, fmt(".3f")),
    ("TTFT p95 (s)", lambda r: r.ttft_p95_s, fmt(".3f")),
    ("tokens loaded", lambda r: r.extra["tokens_loaded_total"], fmt(",")),
    ("  from the CPU tiers", lambda r: r.tokens_loaded_from_cpu, fmt(",")),
    ("  from the shared tier", lambda r: r.extra.get("tokens_loaded_from_shared"), fmt(",")),
    ("tokens recomputed", lambda r: r.tokens_recomputed, fmt(",")),
    ("prompt tokens computed", lambda r: r.prompt_tokens_computed, fmt(",")),
    ("admission deferrals", lambda r: r.admission_deferrals, fmt(",")),
    ("admissions checked / mispredicted", lambda r: f"{r.extra['admissions_checked']:,} / "
                                                    f"{r.extra['admission_mismatches']:,}", str),
    ("shared tier blocks written / fetched", lambda r: None if "shared_blocks_written" not in r.extra else
     f"{r.extra['shared_blocks_written']:,} / {r.extra['shared_blocks_fetched']:,}", lambda v: v or "-"),
    ("shared tier bytes put / fetched", lambda r: None if "shared_bytes_put" not in r.extra else
     f"{_gib(r.extra['shared_bytes_put'])} / {_gib(r.extra['shared_bytes_fetched'])}", lambda v: v or "-"),
    ("shared tier write skips / fetch failures", lambda r: None if "shared_write_skips" not in r.extra else
     f"{r.extra['shared_write_skips']:,} / {r.extra['shared_fetch_failures']:,}", lambda v: v or "-"),
    ("shared store evictions (values / bytes)", lambda r: None if "shared_evictions" not in r.extra else
     f"{r.extra['shared_evictions']:,} / {_gib(r.extra['shared_evicted_bytes'])}", lambda v: v or "-"),
    ("shared store bytes held at the end", lambda r: r.extra.get("shared_store_bytes"), _gib),
    ("CPU tier bytes (all engines)", lambda r: r.cpu_tier_bytes, _gib),
    ("  per cached token", lambda r: r.cpu_tier_bytes_per_cached_token, fmt_bytes),
    ("  without spare windows", lambda r: r.extra.get("cpu_tier_bytes_per_cached_token_without_spare"),
     fmt_bytes),
    ("bytes loaded / stored (host<->GPU)",
     lambda r: f"{_gib(r.transfer_bytes_loaded)} / {_gib(r.transfer_bytes_stored)}", str),
    ("loads content-checked", lambda r: r.extra.get("loads_content_checked"), fmt(",")),
    ("steps (all engines)", lambda r: r.steps, fmt(",")),
    ("wall seconds (replay loop)", lambda r: r.wall_seconds, fmt(".1f")),
]


def render(results: list[ConnectorResult]) -> str:
    from offload_bench.replay.table import render as render_rows

    return render_rows(results, spec=ROWS, per_group=False)


def _capacity(shared_bytes: int | None) -> str:
    if shared_bytes is None:
        return "unbounded (never evicts)"
    return (f"capacity {_gib(shared_bytes)} ({shared_bytes:,} bytes), least recently used values evicted (as Redis "
            f"allkeys-lru; a block's value counts its real bytes)")


def header(out: RouterOutput) -> str:
    from offload_bench.replay.table import header as replay_header

    cfg = out.config
    lines = replay_header(out).splitlines()
    lines[0] = lines[0].replace("replay: ", f"router replay: {cfg.engines} engines, {cfg.router} by arrival (no "
                                            f"session affinity), ", 1)
    lines[1] = lines[1].replace("pool ", "per engine: pool ", 1)
    return "\n".join(lines + [
        f"shared tier ({SHARED} column): one simulated in-process store shared by every engine (sim/remote.py), "
        f"behind the connector's real remote_store path; per engine one call at a time, {cfg.shared_latency_ms:g} ms "
        f"+ bytes / {cfg.shared_bandwidth_gbps:g} GB/s each; marker lookups take no simulated time; "
        f"{_capacity(cfg.shared_bytes)}",
        "tokens recomputed: prompt tokens computed that some engine had computed before the request arrived; "
        "tokens loaded from the shared tier: those whose full-attention blocks a load fetched from the store (they "
        "then stay in that engine's CPU tier: later loads of them count as from the CPU tiers)",
    ])
