"""The 64 hybrid runs of this folder (paired draft draws), per model, vLLM and drafts: worst ratio over the workloads,
token sums; then every run. Run from this folder: python3 table.py"""
import glob, json, os, collections
rows = []
for f in sorted(glob.glob("v0*.json")):
    name = os.path.basename(f)[:-5]
    tag, rest = name.split("-", 1)
    model, workload, k = rest.split("--")
    d = json.load(open(f)); c = {r["connector"]: r for r in d["results"]}
    a, b = c["offload"], c["vllm-offloading"]
    r = lambda x, y: x / y if y else (1.0 if x == 0 else float("inf"))
    rows.append(dict(vllm="0." + tag[2:], model=model, workload=workload, k=k,
                     drafts=d["config"].get("num_speculative_tokens") or 0,
                     thr=a["output_tokens_per_s"] / b["output_tokens_per_s"],
                     thl=a["extra"]["output_tokens_per_s_to_last_token"] / b["extra"]["output_tokens_per_s_to_last_token"],
                     p50=r(a["ttft_p50_s"], b["ttft_p50_s"]), p95=r(a["ttft_p95_s"], b["ttft_p95_s"]),
                     rec=(a["tokens_recomputed"], b["tokens_recomputed"]), load=(a["tokens_loaded_from_cpu"], b["tokens_loaded_from_cpu"]),
                     stall=a["stalled"] or b["stalled"]))
groups = collections.OrderedDict()
for x in sorted(rows, key=lambda x: (x["vllm"], x["model"], x["k"])):
    groups.setdefault((x["vllm"], x["model"], x["k"]), []).append(x)
print("| model | vLLM | drafts | workloads | stalls (either column) | throughput, worst | to the last token, worst | TTFT p50, worst | TTFT p95, worst | recomputed, ours / vLLM's | loaded, ours / vLLM's |")
print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for (v, m, k), xs in groups.items():
    print(f"| {m} | {v} | {'MTP 2' if k == 'k2' else 'none'} | {len(xs)} | {sum(x['stall'] for x in xs)} | "
          f"{min(x['thr'] for x in xs):.4f} | {min(x['thl'] for x in xs):.4f} | {max(x['p50'] for x in xs):.4f} | "
          f"{max(x['p95'] for x in xs):.4f} | {sum(x['rec'][0] for x in xs):,} / {sum(x['rec'][1] for x in xs):,} | "
          f"{sum(x['load'][0] for x in xs):,} / {sum(x['load'][1] for x in xs):,} |")
print()
print(f"runs: {len(rows)}; stalls: {sum(x['stall'] for x in rows)}; throughput below 1: {sum(x['thr'] < 1 for x in rows)}; "
      f"to the last token below 1: {sum(x['thl'] < 1 for x in rows)}; TTFT p50 above 1: {sum(x['p50'] > 1 for x in rows)}; "
      f"p95 above 1: {sum(x['p95'] > 1 for x in rows)}; recomputed more: {sum(x['rec'][0] > x['rec'][1] for x in rows)}")
