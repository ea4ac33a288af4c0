"""Ours ÷ a reference column, per replay JSON (`offload-connector replay --json F`), one row per file.

    offload-connector replay-ratios results/*.json [--ours offload] [--vs vllm-offloading-patched] [--markdown]

Throughput (output tokens per simulated second: higher is better), TTFT p50 / p95 and tokens recomputed (lower is
better) as ratios to 4 digits; a stall in either column, the requests each completed, and the deferrals our column
held back for an older load. A file without both columns is one line saying so. Exit status 2 for a bad argument.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from offload_bench.args import OneLineParser, fail

FIELDS = (("throughput", "output_tokens_per_s"), ("TTFT p50", "ttft_p50_s"), ("TTFT p95", "ttft_p95_s"),
          ("recomputed", "tokens_recomputed"))


def ratio(a: float, b: float) -> float | None:
    if b == 0:
        return 1.0 if a == 0 else None
    return a / b


def row(path: Path, ours: str, vs: str) -> dict[str, Any]:
    data = json.loads(path.read_text())
    cols = {r["connector"]: r for r in data["results"]}
    name = f"{data['workload']} ({data['config']['model']})"
    if ours not in cols or vs not in cols:
        return {"row": name, "missing": sorted({ours, vs} - set(cols))}
    a, b = cols[ours], cols[vs]
    out: dict[str, Any] = {"row": name}
    for label, key in FIELDS:
        out[label] = ratio(float(a[key]), float(b[key]))
    out["stalls"] = f"{'stall' if a['stalled'] else '-'}/{'stall' if b['stalled'] else '-'}"
    out["completed"] = f"{a['requests_completed']}/{b['requests_completed']} of {a['requests_total']}"
    out["held for older"] = (a.get("extra") or {}).get("held_for_older", 0)
    out["aged out tokens"] = (a.get("extra") or {}).get("aged_out_tokens", 0)
    return out


def fmt(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.4f}"
    return str(v)


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="offload-connector replay-ratios", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--ours", default="offload")
    p.add_argument("--vs", default="vllm-offloading-patched")
    p.add_argument("--markdown", action="store_true", help="a Markdown table instead of aligned text")
    args = p.parse_args(argv)
    for f in args.files:
        if not f.is_file():
            return fail(p.prog, f"{f} is not a file")
    try:
        rows = [row(f, args.ours, args.vs) for f in args.files]
    except (ValueError, KeyError) as exc:
        return fail(p.prog, f"not a replay JSON ({exc})")
    heads = ["row", *(label for label, _ in FIELDS), "stalls", "completed", "held for older", "aged out tokens"]
    table = [[fmt(r.get(h, "")) if "missing" not in r else (r["row"] if h == "row" else "") for h in heads]
             for r in rows]
    if args.markdown:
        print("| " + " | ".join(heads) + " |")
        print("|---" * len(heads) + "|")
        for t in table:
            print("| " + " | ".join(t) + " |")
    else:
        widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(heads)]
        print("  ".join(h.ljust(w) for h, w in zip(heads, widths)))
        for t in table:
            print("  ".join(c.ljust(w) for c, w in zip(t, widths)))
    for r in rows:
        if "missing" in r:
            print(f"{r['row']}: no column {', '.join(r['missing'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
