"""A simulated run does not depend on the process's string-hash seed.

vLLM frees the blocks of the requests in `KVConnectorOutput.finished_sending` in iteration order; as a `set[str]`
that order changes with PYTHONHASHSEED, so which of two requests that finish sending in the same step loses its
prefix-cache blocks first (and whether a later request finds its prefix on the GPU or loads it) changed from one
process to the next. Fuzz case 211 of seed 0 (k=4 ngram_gpu, two sessions finishing together) admitted 0 loads under
hash seed 3 and 1 under seeds 4-6 before the simulation handed vLLM sorted ids.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.engine_helpers import REPO

CASE = """
import json, random
from offload_bench.sim.fuzz import random_case, run_case
rng = random.Random(0)
for _ in range(211):
    random_case(rng)
case = random_case(rng)
out = run_case(case)
print(json.dumps({"ok": out.ok, "admissions": out.admissions, "loaded": out.loaded_tokens,
                  "deferrals": out.deferrals, "spec": [case.num_spec_tokens, case.spec_method]}))
"""


def _run(hash_seed: str) -> dict:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "VLLM_TARGET_DEVICE": "cpu",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "benchmarks")])}
    done = subprocess.run([sys.executable, "-c", CASE], capture_output=True, text=True, timeout=600, env=env,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_fuzz_case_is_the_same_under_every_hash_seed() -> None:
    runs = {seed: _run(seed) for seed in ("3", "4")}
    assert runs["3"]["spec"] == [4, "ngram_gpu"], runs  # the case that used to differ
    assert runs["3"] == runs["4"] and runs["3"]["ok"], runs
