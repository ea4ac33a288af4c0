"""Scheduler-side cost per step: our OffloadConnector vs vLLM's in-tree OffloadingConnector (steady decode).

For each N in --requests and each connector, a real vLLM scheduler (the class EngineCore would pick) is built on
CPU for the Gemma-4-31B layout (vLLM's own KV cache planner, offload_bench.sim.layouts), N requests with
distinct 1-2k-token prompts are added and stepped until all N are RUNNING in decode (warm-up, not timed), then
--steps steps of steady decode are timed with time.perf_counter:

  total            Scheduler.schedule() + Scheduler.update_from_output() per step (what the engine core loop pays);
  connector-only   time spent inside the scheduler-role connector's methods called from those two
                   (get_num_new_matched_tokens, update_state_after_alloc, build_connector_meta,
                   update_connector_output, request_finished(_all_groups), get_kv_connector_stats, take_events, ...),
                   outermost calls only.

Connectors: none (baseline), ours (kv_connector_module_path "offload_connector", {"cpu_bytes", "reservation":
"exact"}; its real worker over the simulated copy backend TagCopier, through SchedulerDriver) and vLLM's
OffloadingConnector ({"cpu_bytes_to_use"}; its real WORKER-role connector with only the copy engine faked, see
benchmarks/offload_bench/sim/vllm_offloading.py). By default a second vLLM row sets "offload_prompt_only": false, because
vLLM's default stores nothing during decode while ours stores decode blocks too. Transfers complete one step after
they are issued. Batches are pipelined as EngineCore does under async scheduling (step s+1 is scheduled before
step s's output is applied), identically for all connectors; per step = one schedule() + one update_from_output().
Each configuration is rebuilt and rerun --rounds times (interleaved); the per-round median and mean per step are
reduced by taking the median over rounds.

Both CPU tiers get --cpu-bytes (default 64 GiB = 26,214 host blocks of 2.5 MiB). 256 requests of 1-2k tokens do
not fit in that, and then our connector keeps re-storing whole sliding windows during decode (see the printed
eviction count); a larger --cpu-bytes shows the unsaturated cost.

This is a measurement, not a timed test: nothing fails on a slow result.

    .venv-vllm033/bin/offload-connector sched-overhead [--steps 200] [--requests 64,256] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

from offload_bench.args import OneLineParser, int_in, int_list_in, parse_bytes
from offload_bench.platform import use_cpu_platform

use_cpu_platform()  # before vLLM is imported

MODEL = "gemma-4-31b"
MAX_MODEL_LEN = 4096
PROMPT_MIN, PROMPT_MAX = 1024, 2048

# Scheduler-role connector methods the Scheduler calls (those a connector lacks are skipped).
CONNECTOR_METHODS = (
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "update_connector_output",
    "request_finished", "request_finished_all_groups", "has_pending_push_work", "has_pending_block_frees",
    "get_external_cache_hit_sources", "get_loaded_kv_cache_group_ids", "register_finished_partial_tail",
    "get_kv_connector_stats", "take_events", "on_new_request",
)

KINDS = {
    "none": "no connector (baseline)",
    "ours": "OffloadConnector (ours, reservation=exact)",
    "vllm": "vLLM OffloadingConnector (defaults)",
    "vllm-decode": "vLLM OffloadingConnector, offload_prompt_only=false",
}


# --------------------------------------------------------------------------- timing proxies
class StepTimer:
    """Per-step accumulators for schedule/update_from_output and the connector calls made inside them."""

    def __init__(self) -> None:
        self.inside = 0  # >0 while inside schedule() or update_from_output()
        self.conn_depth = 0
        self.sched_s = 0.0
        self.conn_s = 0.0
        self.conn_calls = 0

    def reset(self) -> None:
        self.sched_s = self.conn_s = 0.0
        self.conn_calls = 0

    def wrap_scheduler(self, sched: Any, name: str) -> None:
        inner = getattr(sched, name)
        clock = time.perf_counter

        def timed(*a: Any, **kw: Any) -> Any:
            self.inside += 1
            t0 = clock()
            try:
                return inner(*a, **kw)
            finally:
                self.sched_s += clock() - t0
                self.inside -= 1

        setattr(sched, name, timed)

    def wrap_connector(self, conn: Any) -> list[str]:
        wrapped = []
        clock = time.perf_counter
        for name in CONNECTOR_METHODS:
            inner = getattr(conn, name, None)
            if inner is None or not callable(inner):
                continue

            def timed(*a: Any, _inner: Callable = inner, **kw: Any) -> Any:
                if self.conn_depth or not self.inside:  # nested (facade -> itself) or outside the step calls
                    return _inner(*a, **kw)
                self.conn_depth += 1
                t0 = clock()
                try:
                    return _inner(*a, **kw)
                finally:
                    self.conn_s += clock() - t0
                    self.conn_calls += 1
                    self.conn_depth -= 1

            setattr(conn, name, timed)
            wrapped.append(name)
        return wrapped


# --------------------------------------------------------------------------- building
def pool_blocks(n: int, max_tokens_per_req: int) -> int:
    """Blocks for n requests of up to max_tokens_per_req tokens on Gemma-4-31B (5 SWA groups, block 16, window
    1024; 1 full group, block 32), plus a prefill chunk's transient blocks and slack."""
    swa = 5 * (1024 // 16 + 2)
    full = -(-max_tokens_per_req // 32) + 1
    chunk = 5 * (8192 // 16 + 2) + 8192 // 32
    return int(n * (swa + full) * 1.15) + 2 * chunk + 512


def build(kind: str, n: int, args: argparse.Namespace, timed_steps: int) -> tuple[Any, Any, dict[str, Any]]:
    from offload_bench.sim.driver import SchedulerDriver
    from offload_bench.sim.tagcopy import TagCopier
    from offload_bench.sim.layouts import build_scheduler, build_sim_model, build_vllm_config
    from offload_bench.sim.scenarios import connector_config

    kt = None
    if kind == "ours":
        kt = connector_config("exact", args.cpu_bytes)
    elif kind in ("vllm", "vllm-decode"):
        from offload_bench.sim.vllm_offloading import offloading_config
        extra = {"offload_prompt_only": False} if kind == "vllm-decode" else {}
        kt = offloading_config(args.cpu_bytes, **extra)
    max_tokens = PROMPT_MAX + args.warmup_steps + timed_steps + 400
    num_blocks = pool_blocks(n, max_tokens)
    vc = build_vllm_config(MODEL, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=args.max_num_batched_tokens,
                           max_num_seqs=max(256, n), num_gpu_blocks=num_blocks, kv_transfer_config=kt)
    sim = build_sim_model(MODEL, vllm_config=vc, num_blocks=num_blocks)
    sched = build_scheduler(sim, vc)
    info: dict[str, Any] = {"num_blocks": sim.kv_cache_config.num_blocks,
                            "kv_cache_tensors": len(sim.kv_cache_config.kv_cache_tensors),
                            "scheduler_cls": type(sched).__name__}
    if kind in ("none", "ours"):
        drv = SchedulerDriver(sched, TagCopier(1) if kind == "ours" else None, check_loads=False)
    else:
        from offload_bench.sim.vllm_offloading import VllmOffloadingDriver, VllmOffloadingWorkerSim
        # Same batch pipelining as SchedulerDriver (older SchedulerDrivers apply each output at once).
        depth = None if "batch_depth" in inspect.signature(SchedulerDriver).parameters else 1
        drv = VllmOffloadingDriver(sched, VllmOffloadingWorkerSim(vc, sim.worker_kv_cache_config, latency_steps=1),
                                   batch_depth=depth)
    info["batch_depth"] = getattr(drv, "batch_depth", 1)
    return drv, sim, info


def make_requests(n: int, sim: Any) -> list[Any]:
    from offload_bench.sim.requests import make_request, tokens

    rng = random.Random(1234)
    reqs = []
    for i in range(n):
        plen = rng.randrange(PROMPT_MIN, PROMPT_MAX)
        reqs.append(make_request(f"r{i}", tokens(10_000 + i, plen), MAX_MODEL_LEN - plen, sim.hash_block_size))
    return reqs


def stored_blocks(kind: str, drv: Any) -> int:
    if kind == "ours":
        return drv.side.counters.stored_blocks
    if kind.startswith("vllm"):
        eng = drv.worker.engine
        return eng.blocks["store"]
    return 0


def tier_evictions(kind: str, drv: Any) -> int:
    return drv.side.tier.evictions if kind == "ours" else 0


# --------------------------------------------------------------------------- one measurement
def measure(kind: str, n: int, args: argparse.Namespace, progress: Callable[[str], None]) -> dict[str, Any]:
    drv, sim, info = build(kind, n, args, args.steps)
    sched = drv.sched
    timer = StepTimer()
    timer.wrap_scheduler(sched, "schedule")
    timer.wrap_scheduler(sched, "update_from_output")
    conn = sched.get_kv_connector()
    info["wrapped"] = timer.wrap_connector(conn) if conn is not None else []

    reqs = make_requests(n, sim)
    drv.add(reqs)
    progress("warm-up")
    warm = 0
    limit = 40 * n * PROMPT_MAX // args.max_num_batched_tokens + 500

    def all_decoding() -> bool:
        return len(sched.running) == n and all(r.num_computed_tokens >= r.num_prompt_tokens for r in reqs)

    while not all_decoding():
        drv.step()
        warm += 1
        if warm > limit:
            raise RuntimeError(f"{kind} N={n}: not all requests decoding after {warm} steps "
                               f"(running {len(sched.running)}, waiting {len(sched.waiting)})")
    for _ in range(args.warmup_steps):  # let the prefill's stores land and the decode pattern settle
        drv.step()
    warm += args.warmup_steps
    info["warmup_steps"] = warm

    gc.collect()
    progress("timed")
    total, conn_only, calls, sched_tokens = [], [], [], []
    stored0 = stored_blocks(kind, drv)
    evict0 = tier_evictions(kind, drv)
    preempted = 0
    for _ in range(args.steps):
        timer.reset()
        out = drv.step()
        total.append(timer.sched_s)
        conn_only.append(timer.conn_s)
        calls.append(timer.conn_calls)
        tok = getattr(out, "total_num_scheduled_tokens", None)
        if tok is None:  # SchedulerDriver returns a StepRecord
            tok = out.scheduled_tokens
        sched_tokens.append(tok)
        preempted += len(sched.running) != n
    info["stored_blocks_per_step"] = (stored_blocks(kind, drv) - stored0) / args.steps
    info["tier_evictions_per_step"] = (tier_evictions(kind, drv) - evict0) / args.steps
    info["tokens_per_step_min"] = min(sched_tokens)
    info["steps_not_all_running"] = preempted
    info["connector_calls_per_step"] = statistics.mean(calls)
    if kind == "ours":
        info["tier_capacity"] = f"{drv.side.tier.capacity_slots} host blocks"
    elif kind.startswith("vllm"):
        mgr = conn.connector_scheduler.manager
        info["tier_capacity"] = f"{getattr(mgr, '_num_chunks', '?')} chunks"
    return {"kind": kind, "n": n, "total_s": total, "conn_s": conn_only, "info": info}


def summarize(samples: list[float]) -> tuple[float, float]:
    return statistics.median(samples), statistics.fmean(samples)


# --------------------------------------------------------------------------- environment
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="offload-connector sched-overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int_in(1, 10**6), default=200, help="timed decode steps per run (default 200)")
    ap.add_argument("--requests", type=int_list_in(1, 4096), default=[64, 256],
                    help="running-request counts, comma separated")
    ap.add_argument("--rounds", type=int_in(1, 1000), default=3, help="rebuild-and-rerun rounds; median over rounds")
    ap.add_argument("--warmup-steps", type=int_in(0, 10**6), default=20,
                    help="extra untimed decode steps after warm-up")
    ap.add_argument("--max-num-batched-tokens", type=int_in(1, 2**22), default=8192)
    ap.add_argument("--cpu-bytes", type=parse_bytes, default=64 * 2**30,
                    help="CPU tier bytes for both connectors (e.g. 64GiB)")
    ap.add_argument("--no-vllm-decode", action="store_true",
                    help="skip the vLLM offload_prompt_only=false row")
    ap.add_argument("--verbose", action="store_true", help="keep vLLM's warnings")
    ap.add_argument("--json", metavar="PATH", help="write all results (per-step samples included) here")
    args = ap.parse_args(argv)
    ap.check_output("--json", args.json)  # before the run, not after
    ns = args.requests
    kinds = ["none", "ours", "vllm"] + ([] if args.no_vllm_decode else ["vllm-decode"])

    import logging

    import vllm

    if not args.verbose:  # vLLM warns once per connector and scheduler built; keep the progress bar readable
        logging.getLogger("vllm").setLevel(logging.ERROR)
    env = {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
           "vllm": vllm.__version__, "model_layout": MODEL}
    try:
        from tqdm import tqdm
        bar = tqdm(total=len(ns) * len(kinds) * args.rounds, file=sys.stderr, unit="run", dynamic_ncols=True)
    except ImportError:
        bar = None

    t_start = time.perf_counter()
    runs: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        for n in ns:
            for kind in kinds:
                def progress(phase: str, _k: str = kind, _n: int = n, _r: int = rnd) -> None:
                    msg = f"round {_r + 1}/{args.rounds} N={_n} {_k}: {phase}"
                    if bar is not None:
                        bar.set_description(msg)
                    else:
                        print(msg, file=sys.stderr, flush=True)

                res = measure(kind, n, args, progress)
                res["round"] = rnd
                runs.append(res)
                if bar is not None:
                    bar.update(1)
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - t_start

    # Reduce: per round median/mean per step, then the median over rounds.
    table: dict[tuple[int, str], dict[str, Any]] = {}
    for n in ns:
        for kind in kinds:
            rs = [r for r in runs if r["n"] == n and r["kind"] == kind]
            tot = [summarize(r["total_s"]) for r in rs]
            con = [summarize(r["conn_s"]) for r in rs]
            table[(n, kind)] = {
                "total_median_us": statistics.median(t[0] for t in tot) * 1e6,
                "total_mean_us": statistics.median(t[1] for t in tot) * 1e6,
                "conn_median_us": statistics.median(c[0] for c in con) * 1e6,
                "conn_mean_us": statistics.median(c[1] for c in con) * 1e6,
                "rounds_total_median_us": [t[0] * 1e6 for t in tot],
                "rounds_conn_median_us": [c[0] * 1e6 for c in con],
                "info": rs[-1]["info"],
            }

    print()
    print("Scheduler-side cost per step, steady decode, Gemma-4-31B KV layout (vLLM's planner), CPU-only simulation.")
    print(f"  measured on: {env['cpu']} ({env['cores']} cores), Python {env['python']}, vLLM {env['vllm']}")
    print(f"  {args.steps} timed steps per run after warm-up, {args.rounds} rounds (median of per-round "
          f"median / mean), prompts {PROMPT_MIN}-{PROMPT_MAX - 1} tokens, max_num_batched_tokens "
          f"{args.max_num_batched_tokens}, CPU tier {args.cpu_bytes / 2**30:g} GiB, transfer latency 1 step")
    print("  total = schedule() + update_from_output(); connector = time inside the scheduler-role connector's "
          "methods during those calls")
    print("  This is a measurement, not a timed test; wall time of this run: "
          f"{elapsed:.0f} s.")
    print()
    hdr = (f"{'N':>4}  {'connector':<52} {'conn med µs':>11} {'conn mean µs':>12} {'total med µs':>12} "
           f"{'total mean µs':>13} {'Δ vs none µs':>12} {'stored blk/step':>15}")
    print(hdr)
    print("-" * len(hdr))
    for n in ns:
        base = table[(n, "none")]["total_median_us"]
        for kind in kinds:
            row = table[(n, kind)]
            delta = row["total_median_us"] - base
            print(f"{n:>4}  {KINDS[kind]:<52} {row['conn_median_us']:>11.1f} {row['conn_mean_us']:>12.1f} "
                  f"{row['total_median_us']:>12.1f} {row['total_mean_us']:>13.1f} "
                  f"{(delta if kind != 'none' else 0.0):>12.1f} {row['info']['stored_blocks_per_step']:>15.1f}")
    print()
    print("Ratios ours / vLLM (same run; median per step, and mean per step in parentheses):")
    ratios: dict[str, Any] = {}
    for n in ns:
        o = table[(n, "ours")]
        for ref in [k for k in kinds if k.startswith("vllm")]:
            v = table[(n, ref)]
            r = {
                "connector_median": o["conn_median_us"] / v["conn_median_us"],
                "connector_mean": o["conn_mean_us"] / v["conn_mean_us"],
                "total_median": o["total_median_us"] / v["total_median_us"],
                "total_mean": o["total_mean_us"] / v["total_mean_us"],
            }
            ratios[f"{n}/{ref}"] = r
            print(f"  N={n:<4} vs {KINDS[ref]:<52} connector-only {r['connector_median']:6.2f}x "
                  f"({r['connector_mean']:.2f}x)   total {r['total_median']:6.2f}x ({r['total_mean']:.2f}x)")
    print()
    notes = []
    for (n, kind), row in table.items():
        inf = row["info"]
        if inf["steps_not_all_running"] or inf["tokens_per_step_min"] < n:
            notes.append(f"  WARNING N={n} {kind}: {inf['steps_not_all_running']} timed steps without all "
                         f"{n} running; min tokens/step {inf['tokens_per_step_min']}")
    for n in ns:
        o, v = table[(n, "ours")]["info"], table[(n, "vllm")]["info"]
        print(f"  N={n}: CPU tier ours {o['tier_capacity']}, vLLM {v['tier_capacity']}; ours evicted "
              f"{o['tier_evictions_per_step']:.1f} host blocks/step while timed; batch depth {o['batch_depth']}, "
              f"{o['num_blocks']} GPU blocks, warm-up {o['warmup_steps']} steps")
        if o["tier_evictions_per_step"] > 0:
            print(f"  N={n}: ours' CPU tier is full while timed (the N requests' blocks exceed "
                  f"{args.cpu_bytes / 2**30:g} GiB), so decode re-stores sliding windows whose older blocks were "
                  "evicted; compare with a larger --cpu-bytes")
    for line in notes:
        print(line)
    if args.json:
        out = {"env": env, "args": vars(args), "elapsed_s": elapsed, "ratios": ratios,
               "table": [{"n": n, "kind": k, **{kk: vv for kk, vv in v.items()}} for (n, k), v in table.items()],
               "runs": runs}
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
