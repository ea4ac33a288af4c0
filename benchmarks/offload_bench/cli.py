"""`offload-connector` command line.

    offload-connector stall-demo [--model gemma-4-31b|deepseek-v4-flash|all] [--json PATH]
    offload-connector replay [--model M] [--trace T] [--connectors C,...] [--json PATH] [--plot PATH] ...
    offload-connector replay --engines 2 [--router round-robin] [--shared-bandwidth-gbps G] [--trace T] ...
    offload-connector soak [--model gemma-4-31b|deepseek-v4-flash] [--sim-seconds 3600] [--seed 0] [--json PATH] ...
    offload-connector TOOL ...   (layout-sweep, fuzz-ledger, contention, ...: offload_bench/tools; --help lists them)

Every argument is checked before anything runs: a bad one ends the command with exit status 2 and one line on stderr
(`offload-connector SUBCOMMAND: error: ...`), never a traceback (see replay/command.py for the ranges).

`stall-demo` runs the seed stall scenario through vLLM's real scheduler on CPU, once with vLLM's own reservation and
once with the connector's exact ledger, and prints what happened side by side. `replay` replays a workload (built-in
or any Mooncake-format trace) through vLLM's real scheduler for several connectors side by side, in simulated time
(see benchmarks/offload_bench/replay/).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


def _stall_demo(args: argparse.Namespace) -> int:
    from offload_bench.args import ArgError, check_output_path, fail

    try:
        check_output_path("--json", args.json)  # before the scenarios run, not after
    except ArgError as err:
        return fail("offload-connector stall-demo", err)
    from offload_bench.platform import use_cpu_platform

    use_cpu_platform()  # before vLLM is imported
    from offload_bench.sim.scenarios import DEEPSEEK_V4_SEED, GEMMA4_SEED, run_stall_scenario

    import vllm

    scenarios = {"gemma-4-31b": GEMMA4_SEED, "deepseek-v4-flash": DEEPSEEK_V4_SEED}
    chosen = list(scenarios) if args.model == "all" else [args.model]
    rows: list[dict[str, Any]] = []
    for name in chosen:
        scn = scenarios[name]
        print(f"\n== {name}: {scn.sessions} requests of {scn.prompt_tokens:,} tokens returning with "
              f"{scn.prefix_tokens:,}-token prefixes in the CPU tier; pool of {scn.num_blocks:,} blocks"
              f"{f' of {scn.block_tokens} tokens (the same bytes on any release)' if scn.block_tokens else ''}, "
              f"max_num_batched_tokens {scn.max_num_batched_tokens}, async scheduling (vLLM {vllm.__version__})")
        for mode in ("vllm", "exact"):
            t0 = time.time()
            res = run_stall_scenario(scn, mode, progress=lambda msg: print(f"   [{mode}] {msg}", flush=True))
            reserved_now = [sum(a.plan.now) for a in res.admissions]
            rows.append({
                "model": name, "reservation": mode, "stalled": res.stalled,
                "first_stall_step": res.first_stall_step,
                "returning_completed": f"{res.returning_completed}/{scn.sessions}",
                "steps": res.steps, "blocks": res.num_blocks, "free_blocks_end": res.free_blocks_end,
                "pool_drained": res.pool_drained, "loaded_tokens": res.loaded_tokens,
                "deferrals": res.deferrals, "loads_blocks_now": reserved_now,
                "ledger_reserved_at_end": res.snapshot.reserved_blocks, "seconds": round(time.time() - t0, 1),
            })
    cols = ["model", "reservation", "stalled", "first_stall_step", "returning_completed", "steps",
            "blocks", "free_blocks_end", "pool_drained", "loaded_tokens", "deferrals"]
    print()
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in cols]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(str(r[c]).ljust(w) for c, w in zip(cols, widths)))
    print("\nstalled = 100 consecutive steps with no scheduled token while requests wait and no transfer is in "
          "flight.\nreservation=vllm trusts vLLM's own _request_remaining_blocks (comparison only); exact is the "
          "default.")
    if args.json:
        try:
            with open(args.json, "w") as fh:
                json.dump({"vllm": vllm.__version__, "rows": rows}, fh, indent=2)
        except OSError as err:  # checked before the run; the disk filled up or the directory went away since
            print(f"offload-connector stall-demo: error: cannot write the results ({err})", file=sys.stderr)
            return 1
    ok = all((r["reservation"] == "exact") <= (not r["stalled"] and r["pool_drained"]) for r in rows)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("offload-connector: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    from offload_bench.args import OneLineParser
    from offload_bench.tools import TOOLS, tool_main

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in TOOLS:  # a tool parses its own arguments
        return tool_main(argv[0])(argv[1:])

    # Subcommand parsers inherit the class: every argument error is one line, exit status 2.
    ap = OneLineParser(prog="offload-connector", description="offload_connector tools")
    sub = ap.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("stall-demo", help="the seed admission stall: vLLM's reservation vs the exact ledger")
    demo.add_argument("--model", choices=["gemma-4-31b", "deepseek-v4-flash", "all"], default="all")
    demo.add_argument("--json", help="write the results here (the directory must exist)")
    from offload_bench.replay.command import add_parser as add_replay_parser

    add_replay_parser(sub)
    from offload_bench.soak.command import add_parser as add_soak_parser

    add_soak_parser(sub)
    for name, (_, summary) in TOOLS.items():  # listed in --help; dispatched above
        sub.add_parser(name, help=summary, add_help=False)
    args = ap.parse_args(argv)
    if args.cmd == "stall-demo":
        return _stall_demo(args)
    if args.cmd == "replay":
        from offload_bench.replay.command import run as run_replay

        return run_replay(args)
    if args.cmd == "soak":
        from offload_bench.soak.command import run as run_soak_command

        return run_soak_command(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
