"""`offload-connector soak`: our connector for simulated hours under randomized faults, invariants after every step.

See offload_connector/soak/runner.py for what is injected and checked. Exit status 0 only if no invariant was
violated, nothing leaked, nothing stalled and the run drained.
"""

from __future__ import annotations

import argparse
import json
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


def add_parser(sub: Any) -> None:
    from offload_connector.replay.command import parse_bytes

    p = sub.add_parser("soak", help="soak our connector for simulated hours: random aborts, preemptions, load/store "
                       "failures, tiny CPU tier; invariants after every step", description=__doc__)
    p.add_argument("--model", choices=sorted(SOAK_DEFAULTS), default="gemma-4-31b")
    p.add_argument("--sim-seconds", type=float, default=3600.0, help="simulated time to generate arrivals for")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gpu-blocks", type=int, help="GPU KV pool (default: gemma 2188, deepseek 1536)")
    p.add_argument("--cpu-bytes", type=parse_bytes, help="CPU tier (default: gemma 4GB, deepseek 2GB)")
    p.add_argument("--max-model-len", type=int, help="default: gemma 13312, deepseek 131072")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--abort-rate", type=float, default=0.05, help="share of requests aborted at a random time")
    p.add_argument("--abort-window-s", type=float, default=3.0, help="aborts fall in a request's first N sim s")
    p.add_argument("--abort-loading-rate", type=float, default=0.1, help="share of loads aborted mid-copy")
    p.add_argument("--load-failure-rate", type=float, default=0.1, help="share of load jobs that fail")
    p.add_argument("--store-failure-rate", type=float, default=0.02, help="share of store jobs that fail")
    p.add_argument("--preempt-rate", type=float, default=0.002, help="per step: preempt a random running request")
    p.add_argument("--stall-steps", type=int, default=200)
    p.add_argument("--json", help="write the result here")
    p.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    import offload_connector.sim  # noqa: F401  (platform environment before vLLM loads)
    from offload_connector.replay.timemodel import time_model_for
    from offload_connector.soak.runner import SoakConfig, render_summary, run_soak

    d = SOAK_DEFAULTS[args.model]
    try:
        cfg = SoakConfig(model=args.model, sim_seconds=args.sim_seconds, num_gpu_blocks=args.gpu_blocks or
                         d.num_gpu_blocks, cpu_bytes=args.cpu_bytes or d.cpu_bytes,
                         max_num_batched_tokens=args.max_num_batched_tokens,
                         max_model_len=args.max_model_len or d.max_model_len, max_num_seqs=args.max_num_seqs,
                         time_model=time_model_for(args.model), seed=args.seed, abort_rate=args.abort_rate,
                         abort_window_s=args.abort_window_s, abort_loading_rate=args.abort_loading_rate,
                         load_failure_rate=args.load_failure_rate, store_failure_rate=args.store_failure_rate,
                         preempt_rate=args.preempt_rate, stall_steps=args.stall_steps)
    except ValueError as err:
        print(f"offload-connector soak: {err}", file=sys.stderr)
        return 2
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
        with open(args.json, "w") as fh:
            json.dump(res.to_json(), fh, indent=2, default=str)
        print(f"results: {args.json}")
    return 0 if res.ok else 1
