"""The files of the connector a plain CPU-tier load walks through, counted by running one.

In vLLM's real scheduler on CPU (the simulation, gpt-oss-20b layout: a 128-token window and full attention), a
2,049-token prompt is computed and stored, the GPU prefix cache is reset, and the same prompt returns: its 2,048-token
prefix is loaded from the CPU tier. Every function of `offload_connector/` and `kernels/` called from the return's
arrival until it finishes is recorded (`sys.setprofile`); the files are listed in the order first entered, with the
calls into each. The return's one new block is stored too, and the per-step bookkeeping (metrics, watchdog, events)
runs, so the count is an upper bound of the load path proper (issue "A house for the next engineer": at most 12).
`--by-hook` splits the calls by the connector method vLLM (or the worker's step) entered them through, so the load's
own hooks (`get_num_new_matched_tokens`, `update_state_after_alloc`, the worker's `start`/`fence`/`transfer_results`,
`update_connector_output`) read apart from store planning, per-step bookkeeping and the finished request's ranking.
For the two scheduler-side hooks of a load (the lookup, `get_num_new_matched_tokens`, and the start,
`update_state_after_alloc`) it also walks the code as a reader follows it: the functions in the order first called,
a stop at each move to another file, and the returns to a file already left (the issue asks for none).

    PYTHONPATH=.:benchmarks offload-connector load-path [--json F] [--by-hook]
"""
from __future__ import annotations

import collections
import json
import os
import sys
from pathlib import Path

from offload_bench.args import OneLineParser

ROOT = Path(__file__).resolve().parents[3]  # the repository: tools -> offload_bench -> benchmarks -> root
# The connector hooks through which vLLM's scheduler looks a load up and starts it.
SCHEDULER_LOAD_HOOKS = ("offload_connector/connector.py:get_num_new_matched_tokens",
                        "offload_connector/connector.py:update_state_after_alloc")


def stops(functions: list[tuple[str, str]]) -> tuple[int, list[str]]:
    """A reader's walk: the functions in the order first called, (file, name) each; a stop is a move to another
    file, the first one included. Returns the stops and the files the walk came back to after leaving them, in order
    (issue "A house for the next engineer": none on the scheduler side)."""
    path: list[str] = []
    for f, _ in functions:
        if not path or path[-1] != f:
            path.append(f)
    seen: set[str] = set()
    back = []
    for f in path:
        if f in seen:
            back.append(f)
        seen.add(f)
    return len(path), back


def walk(by_hook: dict[str, collections.Counter[str]] | None = None,
         firsts: dict[str, list[tuple[str, str]]] | None = None) -> list[tuple[str, int]]:
    """(file relative to the repository, calls) in the order the load first entered each file. With `by_hook`, also
    the calls per entry point: "file:function" of the outermost connector frame -> file -> calls. With `firsts`, per
    entry point the functions (file, qualified name) in the order first called, over all its calls."""
    from offload_bench.platform import use_cpu_platform
    use_cpu_platform()
    from offload_bench.sim.requests import make_request, tokens
    from offload_bench.sim.scenarios import StallScenario, build

    scn = StallScenario("gpt-oss-20b", num_blocks=1200, max_num_batched_tokens=4096, max_model_len=4096,
                        prefix_tokens=2048, prompt_tokens=2049, sessions=1, cpu_bytes=1 << 30)
    drv, sim = build(scn, "exact")
    prompt = tokens(5, scn.prompt_tokens)
    drv.add([make_request("first", prompt, 1, sim.hash_block_size)])
    drv.run(max_steps=200)
    drv.sched.reset_prefix_cache()
    roots = tuple(str(ROOT / d) + os.sep for d in ("offload_connector", "kernels"))
    calls: collections.Counter[str] = collections.Counter()

    def outer_hook(frame) -> str:  # noqa: ANN001 - a frame
        outer, f = frame, frame.f_back
        while f is not None:
            if f.f_code.co_filename.startswith(roots):
                outer = f
            f = f.f_back
        return f"{os.path.relpath(outer.f_code.co_filename, ROOT)}:{outer.f_code.co_name}"

    seen_fns: set[tuple[str, str, str]] = set()

    def profile(frame, event, arg):  # noqa: ANN001 - sys.setprofile's signature
        if event == "call" and frame.f_code.co_filename.startswith(roots):
            name = os.path.relpath(frame.f_code.co_filename, ROOT)
            calls[name] += 1
            if by_hook is not None or firsts is not None:
                hook = outer_hook(frame)
                if by_hook is not None:
                    by_hook.setdefault(hook, collections.Counter())[name] += 1
                fn = (hook, name, frame.f_code.co_qualname)
                # (a comprehension, generator expression or lambda is read with the function it sits in)
                inline = frame.f_code.co_name.startswith("<")
                if firsts is not None and not inline and fn not in seen_fns:
                    seen_fns.add(fn)
                    firsts.setdefault(hook, []).append(fn[1:])

    drv.add([make_request("return", prompt, 1, sim.hash_block_size)])
    sys.setprofile(profile)
    try:
        result = drv.run(max_steps=200)
    finally:
        sys.setprofile(None)
    if "return" not in result.finished or drv.side.counters.loaded_tokens != scn.prefix_tokens:
        raise RuntimeError(f"the return did not load its prefix (loaded {drv.side.counters.loaded_tokens} tokens)")
    return list(calls.items())  # a Counter keeps first-insertion order


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="offload-connector load-path", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the file list here")
    p.add_argument("--by-hook", action="store_true", help="also list the files entered through each connector hook")
    args = p.parse_args(argv)
    p.check_output("--json", args.json)  # before the run, not after
    hooks: dict[str, collections.Counter[str]] | None = {} if args.by_hook else None
    firsts: dict[str, list[tuple[str, str]]] = {}
    files = walk(hooks, firsts)
    for name, n in files:
        print(f"{n:7,d}  {name}")
    print(f"{len(files)} files")
    if hooks is not None:
        for hook, counts in hooks.items():
            print(f"{hook}: {len(counts)} files: " + ", ".join(f"{f} {n:,d}" for f, n in counts.items()))
    # The load's own scheduler-side hooks, read as a reader follows them: stops, and the files come back to.
    load_stops = {}
    for hook in SCHEDULER_LOAD_HOOKS:
        n, back = stops(firsts.get(hook, []))
        load_stops[hook] = {"stops": n, "returns": len(back), "returned_to": sorted(set(back))}
        print(f"{hook}: {n} stops, {len(back)} returns to a file already left ({', '.join(sorted(set(back)))})")
    if args.json:
        out: dict[str, object] = {"files": dict(files), "scheduler_stops": load_stops}
        if hooks is not None:
            out["by_hook"] = {hook: dict(counts) for hook, counts in hooks.items()}
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
