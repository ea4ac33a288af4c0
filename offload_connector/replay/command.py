"""`offload-connector replay`: arguments, defaults per model and workload, progress, table, JSON and plot."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from typing import Any

from offload_connector.replay import CONNECTORS


@dataclass(frozen=True)
class ModelDefaults:
    num_gpu_blocks: int
    cpu_bytes: int
    max_model_len: int
    trace: str | None


# models-and-traces.md §5: the Gemma seed pool, and DeepSeek-V4-Flash cell A. gpt-oss-20b: chosen for pressure, like
# Gemma's, not from a deployment (an H100 would hold ~60 GB of its KV): 2,304 blocks of 16 tokens (384 KiB per block
# id: 0.84 GiB, 36k tokens) is about the smallest pool in which a cold max_model_len request (2,048 full + 137 window
# blocks) still fits. The 8 GiB tier holds about 320k tokens at the 26 KiB per cached token measured on the
# built-in reuse workloads, less than their distinct prompt tokens, so the tier evicts too.
GPU_BLOCKS_GPT_OSS = 2304
MODEL_DEFAULTS = {
    "gemma-4-31b": ModelDefaults(2188, 40 * 2**30, 32768, "gemma4-31b-returning"),
    "deepseek-v4-flash": ModelDefaults(6144, 48 * 2**30, 1_048_576, "deepseek-v4-flash-1m"),
    "gpt-oss-20b": ModelDefaults(GPU_BLOCKS_GPT_OSS, 8 * 2**30, 32768, "agent-tool-prefix"),
}
DEFAULT_MODEL = "gemma-4-31b"
CUSTOM_DEFAULTS = ModelDefaults(4096, 40 * 2**30, 32768, None)


@dataclass(frozen=True)
class TraceDefaults:
    limit: int | None
    time_scale: float


# The Mooncake synthetic trace is 3,993 requests in 17 minutes averaging 15k prompt tokens: about 3x what one
# simulated accelerator computes. The default replays its first 200 requests with arrivals spread 6x (below
# saturation, so time to first token is not all queueing).
TRACE_DEFAULTS = {"mooncake-synthetic": TraceDefaults(200, 6.0)}

_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30,
             "ti": 2**40}


def parse_bytes(text: str) -> int:
    t = text.strip().lower().removesuffix("b")
    for suf in sorted(_SUFFIXES, key=len, reverse=True):
        if suf and not t.endswith(suf):
            continue
        num = t[: len(t) - len(suf)] if suf else t
        try:
            value = float(num)
        except ValueError:
            break
        if value > 0 and math.isfinite(value):
            return int(value * _SUFFIXES[suf])
        break
    raise argparse.ArgumentTypeError(f"{text!r} is not a byte size (e.g. 40GiB, 64g, 512Mi, 1000000)")


def _offload_config(text: str) -> dict[str, Any]:
    """Parsed and validated before anything runs, with the connector's own config checks."""
    from offload_connector.config import ConfigError, OffloadConfig

    try:
        extra = json.loads(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(extra, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    if "cpu_bytes" in extra or "reservation" in extra:
        raise argparse.ArgumentTypeError("cpu_bytes and reservation are set by --cpu-bytes and the column")
    try:
        OffloadConfig.from_extra_config({"cpu_bytes": 1, **extra})
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return extra


def add_parser(sub: Any) -> None:
    p = sub.add_parser("replay", help="replay a workload through vLLM's real scheduler with several connectors",
                       description=__doc__)
    p.add_argument("--model", help="gemma-4-31b, deepseek-v4-flash, gpt-oss-20b, or a path to a config.json "
                   "(default: the built-in workload's model, else gemma-4-31b)")
    p.add_argument("--trace", help="built-in workload (gemma4-31b-returning, deepseek-v4-flash-1m, "
                   "mooncake-synthetic, agent-tool-prefix, rag-shared-docs, decode-heavy) or a Mooncake-format "
                   "JSONL file; default: the model's workload")
    p.add_argument("--connectors", default=",".join(CONNECTORS),
                   help=f"comma-separated, from {', '.join(CONNECTORS)} (default: all)")
    p.add_argument("--gpu-blocks", type=int, help="GPU KV pool blocks (default per model: gemma 2188, deepseek "
                   f"6144, gpt-oss {GPU_BLOCKS_GPT_OSS})")
    p.add_argument("--cpu-bytes", type=parse_bytes, help="CPU tier size (default per model: 40GiB / 48GiB / 8GiB)")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, help="default per model: 32768 / 1048576 / 32768")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="workload generation and prompt token ids")
    p.add_argument("--limit", type=int, help="replay only the first N requests (mooncake-synthetic: 200)")
    p.add_argument("--time-scale", type=float, help="multiply arrival times (mooncake-synthetic: 6.0; else 1.0)")
    p.add_argument("--stall-steps", type=int, default=200, help="K consecutive idle steps that count as a stall")
    p.add_argument("--max-steps", type=int, default=200_000)
    p.add_argument("--bandwidth-gbps", type=float, default=50.0, help="host<->device GB/s per direction")
    p.add_argument("--step-overhead-ms", type=float, help="fixed cost of a step (model default)")
    p.add_argument("--prefill-token-us", type=float, help="cost per prompt token (model default)")
    p.add_argument("--decode-request-us", type=float, help="cost per decoding request (model default)")
    p.add_argument("--no-check-loads", action="store_true", help="skip checking loaded block contents (faster)")
    p.add_argument("--offload-config", type=_offload_config, default={},
                   help='JSON object of kv_connector_extra_config keys for the offload columns, e.g. '
                        '\'{"window_checkpoint_tokens": 0, "admission_policy": "greedy"}\' (cpu_bytes comes from '
                        '--cpu-bytes)')
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", help="write a PNG plot here")
    p.add_argument("--no-progress", action="store_true")


class _Bars:
    """One progress bar per connector (tqdm on stderr), completed requests out of the total."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bars: dict[str, Any] = {}

    def __call__(self, kind: str, done: int, total: int, status: dict[str, Any]) -> None:
        if not self.enabled:
            return
        from tqdm import tqdm

        bar = self.bars.get(kind)
        if bar is None:
            bar = self.bars[kind] = tqdm(total=total, desc=f"{kind:>24}", unit="req", file=sys.stderr,
                                         dynamic_ncols=True, leave=True)
        bar.n = done
        bar.set_postfix_str(f"step {status['step']:,} sim {status['t']:.1f}s "
                            f"run {status.get('run', 0)} wait {status.get('wait', 0)}", refresh=True)
        if status.get("done"):
            bar.close()


def run(args: argparse.Namespace) -> int:
    import offload_connector.sim  # noqa: F401  (platform environment before vLLM loads)
    from offload_connector.replay.pool_dump import format_dump
    from offload_connector.replay.runner import ReplayConfig, run_replay
    from offload_connector.replay.table import header, render
    from offload_connector.replay.timemodel import time_model_for
    from offload_connector.replay.trace import TraceError
    from offload_connector.replay.workloads import resolve_trace
    from offload_connector.sim.layouts import model_dir

    workload = None
    if args.trace is not None:  # first, so that a built-in workload can name the model it was sized for
        try:
            workload = resolve_trace(args.trace, args.seed)
        except (TraceError, FileNotFoundError) as err:
            print(f"offload-connector replay: --trace: {err}", file=sys.stderr)
            return 2
    model = args.model or (workload.default_model if workload else None) or DEFAULT_MODEL
    try:
        model_dir(model)
    except FileNotFoundError as err:
        print(f"offload-connector replay: --model: {err}", file=sys.stderr)
        return 2
    md = MODEL_DEFAULTS.get(model, CUSTOM_DEFAULTS)
    trace = args.trace or md.trace
    if trace is None:
        print("offload-connector replay: --trace is required for a custom model", file=sys.stderr)
        return 2
    if workload is None:
        try:
            workload = resolve_trace(trace, args.seed)
        except (TraceError, FileNotFoundError) as err:
            print(f"offload-connector replay: --trace: {err}", file=sys.stderr)
            return 2
    td = TRACE_DEFAULTS.get(trace, TraceDefaults(None, 1.0))
    try:
        cfg = ReplayConfig(
            model=model, connectors=tuple(c.strip() for c in args.connectors.split(",") if c.strip()),
            num_gpu_blocks=args.gpu_blocks or md.num_gpu_blocks, cpu_bytes=args.cpu_bytes or md.cpu_bytes,
            max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len or md.max_model_len,
            max_num_seqs=args.max_num_seqs, seed=args.seed, stall_steps=args.stall_steps, max_steps=args.max_steps,
            limit=args.limit if args.limit is not None else td.limit,
            time_scale=args.time_scale if args.time_scale is not None else td.time_scale,
            check_loads=not args.no_check_loads, offload_extra=tuple(sorted(args.offload_config.items())),
            time_model=time_model_for(model if model in MODEL_DEFAULTS else "", bandwidth_gbps=
                                      args.bandwidth_gbps, overhead_ms=args.step_overhead_ms,
                                      prefill_token_us=args.prefill_token_us,
                                      decode_request_us=args.decode_request_us))
    except ValueError as err:
        print(f"offload-connector replay: {err}", file=sys.stderr)
        return 2
    t0 = time.time()
    try:
        out = run_replay(workload, cfg, progress=_Bars(not args.no_progress))
    except NotImplementedError as err:  # a config.json whose layer specs the simulation cannot derive
        print(f"offload-connector replay: --model {model}: {err}", file=sys.stderr)
        return 2
    print()
    print(header(out))
    print()
    print(render([r.result for r in out.runs]))
    for r in out.runs:
        if r.result.stall_dump is not None:
            print()
            print(format_dump(r.result.connector, r.result.stall_dump))
    print(f"\nwall time {time.time() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out.to_json(), fh, indent=2, default=str)
        print(f"results: {args.json}")
    if args.plot:
        from offload_connector.replay.plots import plot

        print(f"plot: {plot(out, args.plot)}")
    return 0
