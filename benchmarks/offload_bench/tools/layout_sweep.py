"""Layout sweep: the replay on layouts the project does not ship, every workload, ours against the patched vLLM.

The connector's store points and admission were first measured on three models. This generates layouts a new user
would bring — sliding windows of 128 to 4,096 tokens, one to five windowed groups per full-attention group, chunked
local attention, MLA, block sizes 16 to 128 (vLLM 0.34's default of 64 included), with and without speculative
decoding (the replay simulates it as DeepSeek V4's MTP in this sweep) — as `config.json` files derived from bundled configs (`offload_bench/sim/models`), runs
`offload-connector replay --connectors offload,vllm-offloading-patched` on each with every built-in workload and
the Mooncake trace (one process per case, so a layout vLLM refuses is one line, not the end of the sweep), and
reports per metric the worst case, not the mean:

    offload-connector layout-sweep --out results/sweep [--layouts a,b] [--workloads x,y] [--resume]
        [--offload-config '{"eviction": "lru"}']

Each case's replay JSON is kept in `--out` (`<layout>--<workload>.json`), its outcome appended to `sweep.jsonl`;
`--resume` skips the cases already there, so the sweep can be gathered over several sittings. `--list` prints the
layouts. The summary (`summary.json` and a Markdown table on stdout) names every case outside the issue's bounds:
throughput below 0.999x, or TTFT p50 / p95 or recompute above 1.01x the patched vLLM, or a stall.

Exit status: 0 when every finished case is within bounds, 1 otherwise, 2 for a bad argument (one line).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from offload_bench.args import ArgError, OneLineParser, check_output_dir, fail, float_in
from offload_bench.replay.command import _offload_config

ROOT = Path(__file__).resolve().parents[3]  # the repository: tools -> offload_bench -> benchmarks -> root
MODELS = ROOT / "benchmarks" / "offload_bench" / "sim" / "models"
SMALL_GEMMA4 = ROOT / "docs" / "results" / "layouts" / "small-gemma4" / "config.json"
WORKLOADS = ("gemma4-31b-returning", "deepseek-v4-flash-1m", "mooncake-synthetic", "agent-tool-prefix",
             "rag-shared-docs", "decode-heavy")
MOONCAKE_LIMIT = 1000  # requests of the Mooncake trace per case, as in the built-in rows
BOUNDS = {"throughput": 0.999, "TTFT p50": 1.01, "TTFT p95": 1.01, "recomputed": 1.01}


@dataclass(frozen=True)
class Layout:
    name: str
    family: str  # gemma4 | gpt-oss | llama4 | deepseek-v4
    window: int = 0  # sliding window (gemma4, gpt-oss) or attention chunk (llama4), tokens
    per_full: int = 1  # windowed layers per full-attention layer (gemma4)
    block_size: int = 16
    spec_tokens: int = 0

    def describe(self) -> str:
        kind = {"gemma4": f"{self.per_full} sliding ({self.window}) per full", "gpt-oss": f"sliding {self.window}, 1:1",
                "llama4": f"chunked local {self.window}, 3 per full", "deepseek-v4": "MLA + sliding 128 (bundled)"}
        spec = f", {self.spec_tokens} speculative tokens" if self.spec_tokens else ""
        return f"{kind[self.family]}, block {self.block_size}{spec}"


def _gemma4(w: int, k: int, b: int) -> Layout:
    return Layout(f"gemma4-w{w}-k{k}-b{b}", "gemma4", w, k, b)


LAYOUTS: tuple[Layout, ...] = (
    _gemma4(128, 1, 16), _gemma4(512, 5, 16), _gemma4(1024, 3, 64), _gemma4(4096, 5, 64), _gemma4(4096, 1, 128),
    _gemma4(512, 3, 128),
    Layout("gpt-oss-w128-b64", "gpt-oss", 128, 1, 64), Layout("gpt-oss-w1024-b16", "gpt-oss", 1024, 1, 16),
    Layout("llama4-c8192-b16", "llama4", 8192, 3, 16), Layout("llama4-c2048-b64", "llama4", 2048, 3, 64),
    Layout("llama4-c8192-b128", "llama4", 8192, 3, 128),
    Layout("dsv4-b16", "deepseek-v4", 128, 1, 16), Layout("dsv4-b64", "deepseek-v4", 128, 1, 64),
    # Speculative decoding in this sweep: DeepSeek V4's MTP (the replay simulates a model's MTP where its draft layers'
    # KV caches are known: DeepSeek V4, Qwen3-Next, Qwen3.5).
    Layout("dsv4-b16-mtp2", "deepseek-v4", 128, 1, 16, 2), Layout("dsv4-b64-mtp1", "deepseek-v4", 128, 1, 64, 1),
)


def write_config(layout: Layout, into: Path) -> Path:
    """The layout's `config.json` in `into/<name>/`, derived from a bundled or kept config."""
    if layout.family == "gemma4":
        cfg = json.loads(SMALL_GEMMA4.read_text())
        cfg["sliding_window"] = layout.window
        period = layout.per_full + 1
        n = period * max(1, 30 // period)
        cfg["num_hidden_layers"] = n
        cfg["layer_types"] = ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(n)]
    elif layout.family == "gpt-oss":
        cfg = json.loads((MODELS / "gpt-oss-20b" / "config.json").read_text())
        cfg["sliding_window"] = layout.window
    elif layout.family == "llama4":
        cfg = json.loads((MODELS / "llama-4-scout" / "config.json").read_text())
        text = cfg.get("text_config", cfg)
        text["attention_chunk_size"] = layout.window
    else:
        cfg = json.loads((MODELS / "deepseek-v4-flash" / "config.json").read_text())
    out = into / layout.name / "config.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(cfg, indent=1))
    return out


def ratios(data: dict[str, Any]) -> dict[str, Any]:
    cols = {r["connector"]: r for r in data["results"]}
    a, b = cols["offload"], cols["vllm-offloading-patched"]

    def r(x: float, y: float) -> float | None:
        return (1.0 if x == 0 else None) if y == 0 else x / y
    return {"throughput": r(a["output_tokens_per_s"], b["output_tokens_per_s"]),
            "TTFT p50": r(a["ttft_p50_s"], b["ttft_p50_s"]), "TTFT p95": r(a["ttft_p95_s"], b["ttft_p95_s"]),
            "recomputed": r(a["tokens_recomputed"], b["tokens_recomputed"]),
            "recomputed_tokens": [a["tokens_recomputed"], b["tokens_recomputed"]],
            "stalls": [bool(a["stalled"]), bool(b["stalled"])],
            "completed": [a["requests_completed"], b["requests_completed"], a["requests_total"]],
            "host_kib_per_cached_token": [round(a["cpu_tier_bytes_per_cached_token"] / 1024, 1),
                                          round(b["cpu_tier_bytes_per_cached_token"] / 1024, 1)],
            # Ours less the spare windows (room no regular entry used): what the tier keeps once it is full.
            "host_kib_per_cached_token_without_spare": [_without_spare_kib(a), _without_spare_kib(b)]}


def _without_spare_kib(col: dict[str, Any]) -> float | None:
    value = col.get("extra", {}).get("cpu_tier_bytes_per_cached_token_without_spare")
    return None if value is None else round(value / 1024, 1)


def out_of_bounds(row: dict[str, Any]) -> list[str]:
    why = []
    if any(row["stalls"]):
        why.append("stall")
    if row["throughput"] is not None and row["throughput"] < BOUNDS["throughput"]:
        why.append(f"throughput {row['throughput']:.4f}")
    for k in ("TTFT p50", "TTFT p95", "recomputed"):
        v = row[k]
        if v is None:
            why.append(f"{k}: {row['recomputed_tokens'][0]} tokens where the patched vLLM recomputed none")
        elif v > BOUNDS[k]:
            why.append(f"{k} {v:.4f}")
    return why


def run_case(layout: Layout, workload: str, out: Path, timeout_s: float,
             offload_config: dict[str, Any] | None = None) -> dict[str, Any]:
    cfg = write_config(layout, out / "layouts")
    js = out / f"{layout.name}--{workload}.json"
    cmd = [sys.executable, "-m", "offload_bench", "replay", "--model", str(cfg), "--trace", workload,
           "--connectors", "offload,vllm-offloading-patched", "--no-progress", "--json", str(js),
           "--block-size", str(layout.block_size)]
    if layout.spec_tokens:
        cmd += ["--num-speculative-tokens", str(layout.spec_tokens)]
    if workload == "mooncake-synthetic":
        cmd += ["--limit", str(MOONCAKE_LIMIT)]
    if offload_config:
        cmd += ["--offload-config", json.dumps(offload_config, sort_keys=True)]
    t0 = time.monotonic()
    rec: dict[str, Any] = {"layout": layout.name, "describe": layout.describe(), "workload": workload,
                           "args": [a for a in cmd[3:] if a != str(js)], "offload_config": offload_config or {}}
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {**rec, "error": f"did not finish within {timeout_s:.0f} s", "seconds": round(timeout_s)}
    rec["seconds"] = round(time.monotonic() - t0, 1)
    if proc.returncode != 0 or not js.exists():
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {**rec, "error": f"exit {proc.returncode}: {last[:400]}"}
    row = ratios(json.loads(js.read_text()))
    return {**rec, **row, "outside": out_of_bounds(row)}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    done = [r for r in rows if "error" not in r]
    worst: dict[str, Any] = {}
    for k in ("throughput", "TTFT p50", "TTFT p95", "recomputed"):
        vals = [(r[k], r) for r in done if r[k] is not None]
        if not vals:
            continue
        v, r = (min if k == "throughput" else max)(vals, key=lambda x: x[0])
        worst[k] = {"value": v, "layout": r["layout"], "workload": r["workload"]}
    return {"cases": len(rows), "finished": len(done), "errors": len(rows) - len(done),
            "stalls": sum(1 for r in done if any(r["stalls"])), "worst": worst,
            "outside": [{"layout": r["layout"], "workload": r["workload"], "why": r["outside"]}
                        for r in done if r["outside"]],
            "refused": [{"layout": r["layout"], "workload": r["workload"], "error": r["error"]}
                        for r in rows if "error" in r]}


def markdown(rows: list[dict[str, Any]]) -> str:
    def f(v: Any) -> str:
        return "n/a" if v is None else f"{v:.4f}"
    lines = ["| layout | workload | throughput | TTFT p50 | TTFT p95 | recomputed (tokens, ours / patched) | host KiB "
             "per cached token (ours / patched) |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['layout']} | {r['workload']} | {r['error']} | | | | |")
            continue
        rt = r["recomputed_tokens"]
        lines.append(f"| {r['layout']} | {r['workload']} | {f(r['throughput'])} | {f(r['TTFT p50'])} | "
                     f"{f(r['TTFT p95'])} | {f(r['recomputed'])} ({rt[0]:,} / {rt[1]:,}) | "
                     f"{r['host_kib_per_cached_token'][0]} / {r['host_kib_per_cached_token'][1]} |")
    return "\n".join(lines)


def _pick(text: str | None, allowed: list[str], what: str) -> list[str]:
    if text is None:
        return allowed
    got = [x for x in text.split(",") if x]
    bad = [x for x in got if x not in allowed]
    if bad or not got:
        raise ArgError(f"--{what}: unknown {bad or text!r}; accepted: {', '.join(allowed)}")
    return got


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="offload-connector layout-sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("results/sweep"))
    p.add_argument("--layouts", help="comma-separated layout names (default: all; see --list)")
    p.add_argument("--workloads", help=f"comma-separated (default: all of {', '.join(WORKLOADS)})")
    p.add_argument("--resume", action="store_true", help="skip the cases already in OUT/sweep.jsonl")
    p.add_argument("--timeout", type=float_in(1, 86400), default=3600.0,
                   help="seconds one case may take (default 3600)")
    p.add_argument("--list", action="store_true", help="print the layouts and exit")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--offload-config", type=_offload_config, default={},
                   help="connector settings for our column of every case, as replay's --offload-config (JSON), e.g. "
                        "'{\"eviction\": \"lru\"}'; recorded with each case")
    try:
        args = p.parse_args(argv)
        names = _pick(args.layouts, [lay.name for lay in LAYOUTS], "layouts")
        workloads = _pick(args.workloads, list(WORKLOADS), "workloads")
    except ArgError as exc:
        return fail(p.prog, exc)
    if args.list:
        for lay in LAYOUTS:
            print(f"{lay.name:26s} {lay.describe()}")
        return 0
    try:
        check_output_dir("--out", str(args.out))
        log = args.out / "sweep.jsonl"
        rows = [json.loads(x) for x in log.read_text().splitlines() if x.strip()] if log.exists() else []
    except ArgError as exc:
        return fail(p.prog, exc)
    except (OSError, ValueError) as exc:
        return fail(p.prog, f"--out {args.out}: cannot read {log.name} ({getattr(exc, 'strerror', None) or exc})")
    if not args.resume:
        rows = []
        log.write_text("")
    mixed = sorted({json.dumps(r.get("offload_config", {}), sort_keys=True) for r in rows}
                   - {json.dumps(args.offload_config, sort_keys=True)})
    if mixed:
        return fail(p.prog, f"--resume: {log} holds cases run with --offload-config {mixed[0]}, not "
                            f"{json.dumps(args.offload_config, sort_keys=True)}; use another --out")
    done = {(r["layout"], r["workload"]) for r in rows}
    todo = [(lay, w) for lay in LAYOUTS if lay.name in names for w in workloads if (lay.name, w) not in done]
    os.environ.setdefault("PYTHONPATH", f"{ROOT}{os.pathsep}{ROOT / 'benchmarks'}")
    bar = None
    if not args.no_progress:
        try:
            from tqdm import tqdm
            bar = tqdm(total=len(todo), desc="layout sweep", unit="case")
        except ImportError:
            bar = None
    for lay, w in todo:
        rec = run_case(lay, w, args.out, args.timeout, args.offload_config)
        rows.append(rec)
        with log.open("a") as fh:
            fh.write(json.dumps(rec) + "\n")
        if bar is not None:
            bar.set_postfix_str(f"{lay.name} {w}: {'error' if 'error' in rec else 'ok'}")
            bar.update()
    if bar is not None:
        bar.close()
    summary = summarize(rows)
    summary["layouts"] = [{**asdict(lay), "describe": lay.describe()} for lay in LAYOUTS if lay.name in names]
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(markdown(rows))
    print(f"\n{summary['finished']} of {summary['cases']} cases finished, {summary['errors']} refused or failed, "
          f"{summary['stalls']} stalled, {len(summary['outside'])} outside the bounds")
    return 0 if not summary["outside"] and not summary["stalls"] else 1


if __name__ == "__main__":
    sys.exit(main())
