"""The 24 cases of this folder against the whole sweep at 85e5eb7 (same product code; the replay only reports one more
figure): every field the sweep compares, and the host bytes per cached token with and without spare windows.
Run from this folder: python3 compare_with_85e5eb7.py"""
import json
from pathlib import Path

here = Path(__file__).resolve().parent
old = {(r["layout"], r["workload"]): r
       for r in map(json.loads, (here.parents[1] / "sweep-85e5eb7" / "sweep.jsonl").read_text().splitlines())}
fields = ["throughput", "TTFT p50", "TTFT p95", "recomputed", "recomputed_tokens", "stalls", "completed",
          "host_kib_per_cached_token", "outside"]
same = 0
rows = [json.loads(line) for line in (here / "sweep.jsonl").read_text().splitlines()]
for r in rows:
    diff = [f for f in fields if r.get(f) != old[(r["layout"], r["workload"])].get(f)]
    same += not diff
    if diff:
        print("changed:", r["layout"], r["workload"], diff)
print(f"identical to 85e5eb7: {same} of {len(rows)}")
print("| layout | workload | ours, all entries | ours, without spare windows | patched vLLM | ours without spares / patched |")
print("|---|---|---:|---:|---:|---:|")
for r in rows:
    a, b = r["host_kib_per_cached_token"]
    c = r["host_kib_per_cached_token_without_spare"][0]
    print(f"| {r['layout']} | {r['workload']} | {a} | {c} | {b} | {c / b:.2f} |")
