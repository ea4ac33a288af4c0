"""Ours with a one-shot prompt's checkpoints kept only as spare windows (oneshot-checkpoints.diff), against ours and
the patched vLLM as at 85e5eb7 (the sweep's cases: ../../sweep-85e5eb7/; the nine rows:
../../vllm-034/shares-prefix-2026-12-06/vllm033/; the product code is the same). `python3 compare.py` here prints the
table: ratios ours / patched vLLM (throughput / TTFT p50 / TTFT p95 / recompute) and host KiB per cached token."""
import glob
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
BASES = [os.path.join(HERE, "..", "..", "sweep-85e5eb7"),
         os.path.join(HERE, "..", "..", "vllm-034", "shares-prefix-2026-12-06", "vllm033")]


def col(d, name):
    return next(r for r in d["results"] if r["connector"] == name)


def ratios(o, p):
    return "%.4f / %.4f / %.4f / %.3f" % (o["output_tokens_per_s"] / p["output_tokens_per_s"],
                                         o["ttft_p50_s"] / p["ttft_p50_s"], o["ttft_p95_s"] / p["ttft_p95_s"],
                                         o["tokens_recomputed"] / max(1, p["tokens_recomputed"]))


def kib(o):
    return "%.1f" % (o["cpu_tier_bytes"] / o["cpu_tier_cached_tokens"] / 1024)


print("| case | one-shot checkpoints as spare | 85e5eb7 | host KiB / cached token (one-shot / 85e5eb7 / patched) |")
print("|---|---|---|---|")
for f in sorted(glob.glob(os.path.join(HERE, "*.json"))):
    name = os.path.basename(f)
    base = next(os.path.join(b, name) for b in BASES if os.path.exists(os.path.join(b, name)))
    new = col(json.load(open(f)), "offload")
    old = json.load(open(base))
    o, p = col(old, "offload"), col(old, "vllm-offloading-patched")
    print(f"| {name[:-5]} | {ratios(new, p)} | {ratios(o, p)} | {kib(new)} / {kib(o)} / {kib(p)} |")
