"""`offload-connector soak`: our connector for simulated hours under randomized faults, invariants after every step.

See benchmarks/offload_bench/soak/runner.py for what is injected and checked. Exit status 0 only if no invariant was
violated, nothing leaked, nothing stalled and the run drained.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SoakDefaults:
    num_gpu_blocks: int  # small for the load: vLLM's pool is under pressure
    cpu_bytes: int  # a few requests' worth: the tier evicts all the time
    max_model_len: int  # the largest vLLM accepts on that pool


SOAK_DEFAULTS = {
    "gemma-4-31b": SoakDefaults(2188, 4 * 10**9, 13312),
    "deepseek-v4-flash": SoakDefaults(1536, 2 * 10**9, 131072),
}


# One simulated day, 24x the README's hour: arrivals are generated up front and a few numbers are kept per step
# (1e12 ran out of memory building the arrivals).
MAX_SIM_SECONDS = 86400.0
MAX_ABORT_WINDOW_S = 86400.0
PROG = "offload-connector soak"


def add_parser(sub: Any) -> None:
    from offload_bench.args import float_in, int_in, parse_bytes
    from offload_bench.replay.command import (MAX_BATCHED_TOKENS, MAX_GPU_BLOCKS, MAX_MODEL_LEN, MAX_NUM_SEQS,
                                                  MAX_SEED, MAX_STALL_STEPS, MIN_GPU_BLOCKS, MIN_MODEL_LEN)

    rate = float_in(0.0, 1.0)
    p = sub.add_parser("soak", help="soak our connector for simulated hours: random aborts, preemptions, load/store "
                       "failures, tiny CPU tier; invariants after every step", description=__doc__)
    p.add_argument("--model", choices=sorted(SOAK_DEFAULTS), default="gemma-4-31b")
    p.add_argument("--sim-seconds", type=float_in(1.0, MAX_SIM_SECONDS), default=3600.0,
                   help=f"simulated time to generate arrivals for, 1 to {MAX_SIM_SECONDS:,.0f}")
    p.add_argument("--seed", type=int_in(0, MAX_SEED), default=0, help="0 to 2^63-1")
    p.add_argument("--gpu-blocks", type=int_in(MIN_GPU_BLOCKS, MAX_GPU_BLOCKS),
                   help="GPU KV pool, at least one max_model_len request's worth (default: gemma 2188, deepseek 1536)")
    p.add_argument("--cpu-bytes", type=parse_bytes, help="CPU tier, at least one host block (default: gemma 4GB, "
                   "deepseek 2GB)")
    p.add_argument("--max-model-len", type=int_in(MIN_MODEL_LEN, MAX_MODEL_LEN),
                   help="at least 2 (default: gemma 13312, deepseek 131072)")
    p.add_argument("--max-num-batched-tokens", type=int_in(1, MAX_BATCHED_TOKENS), default=1024,
                   help=f"1 to {MAX_BATCHED_TOKENS:,}, at least --max-num-seqs")
    p.add_argument("--max-num-seqs", type=int_in(1, MAX_NUM_SEQS), default=64, help=f"1 to {MAX_NUM_SEQS:,}")
    p.add_argument("--abort-rate", type=rate, default=0.05, help="share of requests aborted at a random time, 0 to 1")
    p.add_argument("--abort-window-s", type=float_in(0.0, MAX_ABORT_WINDOW_S), default=3.0,
                   help=f"aborts fall in a request's first N sim s, 0 to {MAX_ABORT_WINDOW_S:,.0f}")
    p.add_argument("--abort-loading-rate", type=rate, default=0.1, help="share of loads aborted mid-copy")
    p.add_argument("--load-failure-rate", type=rate, default=0.1, help="share of load jobs that fail")
    p.add_argument("--store-failure-rate", type=rate, default=0.02, help="share of store jobs that fail")
    p.add_argument("--preempt-rate", type=rate, default=0.002, help="per step: preempt a random running request")
    p.add_argument("--stall-steps", type=int_in(1, MAX_STALL_STEPS), default=200, help=f"1 to {MAX_STALL_STEPS:,}")
    p.add_argument("--json", help="write the result here (the directory must exist)")
    p.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    from offload_bench.args import ArgError, check_output_path, fail, write_failed
    from offload_bench.replay.command import check_batch, check_progress, preflight
    from offload_bench.replay.timemodel import time_model_for

    try:  # before vLLM loads
        check_batch(args)
        check_output_path("--json", args.json)
        check_progress(args)
    except ArgError as err:
        return fail(PROG, err)

    from offload_bench.platform import use_cpu_platform

    use_cpu_platform()  # before vLLM is imported
    from offload_bench.replay.timemodel import SimClock
    from offload_bench.soak.runner import SoakConfig, SoakEngine, render_summary, run_soak

    d = SOAK_DEFAULTS[args.model]
    pick = lambda given, default: default if given is None else given  # noqa: E731  (0 is not "unset")
    try:
        cfg = SoakConfig(model=args.model, sim_seconds=args.sim_seconds,
                         num_gpu_blocks=pick(args.gpu_blocks, d.num_gpu_blocks), cpu_bytes=pick(args.cpu_bytes,
                         d.cpu_bytes), max_num_batched_tokens=args.max_num_batched_tokens,
                         max_model_len=pick(args.max_model_len, d.max_model_len), max_num_seqs=args.max_num_seqs,
                         time_model=time_model_for(args.model), seed=args.seed, abort_rate=args.abort_rate,
                         abort_window_s=args.abort_window_s, abort_loading_rate=args.abort_loading_rate,
                         load_failure_rate=args.load_failure_rate, store_failure_rate=args.store_failure_rate,
                         preempt_rate=args.preempt_rate, stall_steps=args.stall_steps)
    except ValueError as err:
        return fail(PROG, err)
    problem = preflight([("soak", lambda: SoakEngine(cfg, SimClock(cfg.time_model), random.Random(0), 0.0, 0.0))],
                        cfg)
    if problem is not None:
        return fail(PROG, problem)
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=round(cfg.sim_seconds), desc=f"soak {args.model}", unit="sim s", file=sys.stderr,
                   dynamic_ncols=True)

    def progress(t: float, status: dict[str, Any]) -> None:
        if bar is None:
            return
        bar.n = min(round(t), bar.total) if not status.get("finished") else bar.total
        if status.get("finished"):
            bar.close()
            return
        bar.set_postfix_str(f"step {status['step']:,} run {status['run']} wait {status['wait']} "
                            f"done {status['done']:,} abort {status['aborted']} loadfail {status['lf']} "
                            f"preempt {status['pre']}", refresh=True)

    res = run_soak(cfg, progress)
    print()
    print(f"soak {args.model}: vLLM {res.vllm}, seed {cfg.seed}, pool {res.settings['num_blocks']:,} blocks, "
          f"CPU tier {cfg.cpu_bytes:,} B = {res.settings['cpu_tier_slots']:,} host blocks, "
          f"max_model_len {cfg.max_model_len:,}; faults: abort {cfg.abort_rate} of requests + {cfg.abort_loading_rate} "
          f"of loads mid-copy, load failures {cfg.load_failure_rate}, store failures {cfg.store_failure_rate}, "
          f"forced preemption {cfg.preempt_rate}/step")
    print(render_summary([res]))
    for p in res.problems:
        print(f"  ! {p}")
    if args.json:
        try:
            with open(args.json, "w") as fh:
                json.dump(res.to_json(), fh, indent=2, default=str)
        except OSError as err:  # checked before the run; the disk filled up or the directory went away since
            return write_failed(PROG, err)
        print(f"results: {args.json}")
    return 0 if res.ok else 1
