"""The full soak, both models: `offload-connector soak` for Gemma 4 31B and DeepSeek-V4-Flash, one after the other
(or in parallel with --jobs 2), and the summary table side by side (the README's soak table).

    HF_HUB_OFFLINE=1 VLLM_TARGET_DEVICE=cpu PYTHONPATH=. .venv-vllm033/bin/python benchmarks/soak.py \
        --sim-seconds 3600 --seed 0 --json results/soak.json

Exit status 0 only if every run drained with no invariant violation, leak or stall.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MODELS = ("gemma-4-31b", "deepseek-v4-flash")


def _one(model: str, sim_seconds: float, seed: int) -> dict:
    import offload_connector.sim  # noqa: F401
    from offload_connector.replay.timemodel import time_model_for
    from offload_connector.soak.command import SOAK_DEFAULTS
    from offload_connector.soak.runner import SoakConfig, run_soak

    d = SOAK_DEFAULTS[model]
    cfg = SoakConfig(model=model, sim_seconds=sim_seconds, num_gpu_blocks=d.num_gpu_blocks, cpu_bytes=d.cpu_bytes,
                     max_num_batched_tokens=1024, max_model_len=d.max_model_len, max_num_seqs=64,
                     time_model=time_model_for(model), seed=seed)
    return run_soak(cfg).to_json()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sim-seconds", type=float, default=3600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args()
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        outs = list(pool.map(_one, models, [args.sim_seconds] * len(models), [args.seed] * len(models)))
    from offload_connector.soak.runner import SoakResult, render_summary

    fields = set(SoakResult.__dataclass_fields__)
    results = [SoakResult(**{k: v for k, v in o.items() if k in fields}) for o in outs]
    print(render_summary(results))
    for r in results:
        for p in r.problems:
            print(f"  ! {r.model}: {p}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(outs, fh, indent=2, default=str)
    return 0 if all(o["ok"] for o in outs) else 1


if __name__ == "__main__":
    sys.exit(main())
