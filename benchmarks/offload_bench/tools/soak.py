"""The full soak, both models: `offload-connector soak` for Gemma 4 31B and DeepSeek-V4-Flash, one after the other
(or in parallel with --jobs 2), and the summary table side by side (the README's soak table).

    HF_HUB_OFFLINE=1 VLLM_TARGET_DEVICE=cpu PYTHONPATH=. .venv-vllm033/bin/offload-connector soak-all \
        --sim-seconds 3600 --seed 0 --json results/soak.json

Exit status 0 only if every run drained with no invariant violation, leak or stall; 2 (one line on stderr) for a bad
argument, before anything runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor


MODELS = ("gemma-4-31b", "deepseek-v4-flash")


def _one(model: str, sim_seconds: float, seed: int) -> dict:
    from offload_bench.platform import use_cpu_platform

    use_cpu_platform()  # before vLLM is imported
    from offload_bench.replay.timemodel import time_model_for
    from offload_bench.soak.command import SOAK_DEFAULTS
    from offload_bench.soak.runner import SoakConfig, run_soak

    d = SOAK_DEFAULTS[model]
    cfg = SoakConfig(model=model, sim_seconds=sim_seconds, num_gpu_blocks=d.num_gpu_blocks, cpu_bytes=d.cpu_bytes,
                     max_num_batched_tokens=1024, max_model_len=d.max_model_len, max_num_seqs=64,
                     time_model=time_model_for(model), seed=seed)
    return run_soak(cfg).to_json()


MAX_JOBS = 16


def main(argv: list[str] | None = None) -> int:
    from offload_bench.args import ArgError, OneLineParser, check_output_path, fail, float_in, int_in, write_failed
    from offload_bench.replay.command import MAX_SEED
    from offload_bench.soak.command import MAX_SIM_SECONDS

    prog = "offload-connector soak-all"
    ap = OneLineParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sim-seconds", type=float_in(1.0, MAX_SIM_SECONDS), default=3600.0,
                    help=f"1 to {MAX_SIM_SECONDS:,.0f}")
    ap.add_argument("--seed", type=int_in(0, MAX_SEED), default=0)
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    ap.add_argument("--jobs", type=int_in(1, MAX_JOBS), default=1, help=f"processes, 1 to {MAX_JOBS}")
    ap.add_argument("--json", help="write the results here (the directory must exist)")
    args = ap.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    try:
        bad = [m for m in models if m not in MODELS]
        if not models:
            raise ArgError(f"--models: none given; choose from {', '.join(MODELS)}")
        if bad:
            raise ArgError(f"--models: {bad} not known; choose from {', '.join(MODELS)}")
        if len(set(models)) != len(models):
            raise ArgError(f"--models: {sorted({m for m in models if models.count(m) > 1})} given more than once")
        check_output_path("--json", args.json)  # before an hour of simulation, not after
    except ArgError as err:
        return fail(prog, err)
    with ProcessPoolExecutor(max_workers=min(args.jobs, len(models))) as pool:
        outs = list(pool.map(_one, models, [args.sim_seconds] * len(models), [args.seed] * len(models)))
    from offload_bench.soak.runner import SoakResult, render_summary

    fields = set(SoakResult.__dataclass_fields__)
    results = [SoakResult(**{k: v for k, v in o.items() if k in fields}) for o in outs]
    print(render_summary(results))
    for r in results:
        for p in r.problems:
            print(f"  ! {r.model}: {p}")
    if args.json:
        try:
            with open(args.json, "w") as fh:
                json.dump(outs, fh, indent=2, default=str)
        except OSError as err:  # checked before the run; the disk filled up or the directory went away since
            return write_failed(prog, err)
    return 0 if all(o["ok"] for o in outs) else 1


if __name__ == "__main__":
    sys.exit(main())
