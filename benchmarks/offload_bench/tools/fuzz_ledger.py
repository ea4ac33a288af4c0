"""Fuzz the exact reservation ledger on vLLM's real scheduler: random layouts, pools, request mixes, arrival orders.

Every example checks: the predicted per-group blocks of each admitted load equal what vLLM allocated; no request
ever holds more blocks in a group than the ledger reserved for it (per admitted load through its first decode step,
and per ledger row every step); no step
schedules zero tokens while requests wait and no transfer is in flight; the run drains and the pool returns to
num_blocks - 1 free; loaded blocks hold the contents that were stored. Speculative decoding settings are drawn per
example (0/1/2/4 drafts; CPU n-gram on a synchronous engine, GPU n-gram, a draft model or EAGLE under async
scheduling); the counts are also broken down by setting. Prints the counts, never a pass/fail timing.

    .venv-vllm033/bin/offload-connector fuzz-ledger --examples 10000 --seed 0
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time


from offload_bench.platform import use_cpu_platform

use_cpu_platform()  # before vLLM is imported
from offload_bench.args import OneLineParser, int_in
from offload_bench.sim.fuzz import random_case, run_case


MAX_EXAMPLES = 10**7


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="offload-connector fuzz-ledger", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int_in(1, MAX_EXAMPLES), default=10_000)
    ap.add_argument("--seed", type=int_in(0, 2**63 - 1), default=0)
    ap.add_argument("--json", help="write the summary here")
    args = ap.parse_args(argv)
    ap.check_output("--json", args.json)  # before the run, not after
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    rng = random.Random(args.seed)
    totals = {"examples": 0, "mismatches": 0, "peak_violations": 0, "loads_peak_checked": 0, "stalls": 0, "idle_zero_token_steps": 0,
              "idle_steps_vllm_own": 0, "idle_steps_exact_need": 0, "undrained": 0,
              "starved": 0, "deferred_loads": 0, "longest_deferral": 0,
              "errors": 0, "admitted_loads": 0, "whole_prompt_loads": 0, "loaded_tokens": 0, "deferrals": 0,
              "too_big": 0,
              "drafts_scheduled": 0, "drafts_accepted": 0}
    by_spec: dict[str, dict[str, int]] = {}
    by_pp: dict[str, dict[str, int]] = {}
    by_family: dict[str, dict[str, int]] = {}  # Mamba hybrids apart from attention-only layouts
    failures = []
    start = time.time()
    it = range(args.examples)
    bar = tqdm(it, desc="fuzz", unit="ex") if tqdm else it
    for i in bar:
        case = random_case(rng)
        totals["examples"] += 1
        key = f"k={case.num_spec_tokens}" + (f" {case.spec_method}" if case.num_spec_tokens else "")
        row = by_spec.setdefault(key, {"examples": 0, "admitted_loads": 0, "failed": 0})
        row["examples"] += 1
        pp_row = by_pp.setdefault(f"pp={case.pipeline_parallel_size}", {"examples": 0, "admitted_loads": 0, "failed": 0})
        pp_row["examples"] += 1
        fam_row = by_family.setdefault("mamba hybrid" if any(g[0] == "mamba" for g in case.groups) else "attention only",
                                       {"examples": 0, "admitted_loads": 0, "loaded_tokens": 0, "failed": 0})
        fam_row["examples"] += 1
        try:
            out = run_case(case)
        except Exception as exc:  # an exception is a finding, not a crash of the benchmark
            totals["errors"] += 1
            row["failed"] += 1
            pp_row["failed"] += 1
            fam_row["failed"] += 1
            failures.append({"case": repr(case), "error": repr(exc)})
            continue
        totals["mismatches"] += len(out.mismatches)
        totals["peak_violations"] += len(out.peak_violations)
        totals["loads_peak_checked"] += out.loads_peak_checked
        totals["stalls"] += out.stalls
        totals["idle_zero_token_steps"] += out.idle_zero_steps
        totals["idle_steps_vllm_own"] += out.vllm_idle_steps
        totals["idle_steps_exact_need"] += out.idle_exact_holds
        totals["undrained"] += out.undrained
        totals["starved"] += len(out.starved)
        totals["deferred_loads"] += out.deferred_loads
        totals["longest_deferral"] = max(totals["longest_deferral"], out.longest_deferral)
        totals["admitted_loads"] += out.admissions
        totals["loaded_tokens"] += out.loaded_tokens
        for name in ("whole_prompt_loads", "deferrals", "too_big", "drafts_scheduled", "drafts_accepted"):
            totals[name] += getattr(out, name)
        row["admitted_loads"] += out.admissions
        pp_row["admitted_loads"] += out.admissions
        fam_row["admitted_loads"] += out.admissions
        fam_row["loaded_tokens"] += out.loaded_tokens
        if not out.ok:
            row["failed"] += 1
            pp_row["failed"] += 1
            fam_row["failed"] += 1
            failures.append({"case": repr(case), "mismatches": out.mismatches[:3],
                             "peak_violations": out.peak_violations[:3], "stalls": out.stalls, "starved": out.starved[:3],
                             "idle_zero_steps": out.idle_zero_steps, "undrained": out.undrained})
        if tqdm and i % 50 == 0:
            bar.set_postfix(mismatch=totals["mismatches"], peak=totals["peak_violations"], stalls=totals["stalls"],
                            errors=totals["errors"])
    totals["seconds"] = round(time.time() - start, 1)
    import vllm
    totals["vllm"] = vllm.__version__
    totals["seed"] = args.seed
    totals["by_spec"] = dict(sorted(by_spec.items()))
    totals["by_pp"] = dict(sorted(by_pp.items()))
    totals["by_family"] = dict(sorted(by_family.items()))
    print(json.dumps(totals, indent=2))
    for f in failures[:10]:
        print("FAILURE", f)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"summary": totals, "failures": failures}, fh, indent=2)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
