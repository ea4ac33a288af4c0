"""The contention harness (offload-connector contention) itself: its JUnit reading and summary, and one real run of a
fast test beside a burner, with the summary it writes. The harness's runs of the engine tests are its own job
(scripts/contention), not part of the suite."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from offload_bench.tools import contention

ROOT = Path(__file__).resolve().parents[2]

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_x" name="test_ok" time="1.5"/>
<testcase classname="tests.test_x" name="test_bad" time="2"><failure message="AssertionError: 335 != 188">x</failure>
</testcase>
<testcase classname="tests.test_x" name="test_err" time="0"><error message="fixture died">y</error></testcase>
<testcase classname="tests.test_x" name="test_skip" time="0"><skipped message="no store"/></testcase>
</testsuite></testsuites>"""


def test_junit_is_read_and_summarized(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text(JUNIT)
    cases = contention.parse_junit(xml)
    assert [(c["test"], c["outcome"]) for c in cases] == [
        ("tests/test_x.py::test_ok", "passed"), ("tests/test_x.py::test_bad", "failed"),
        ("tests/test_x.py::test_err", "error"), ("tests/test_x.py::test_skip", "skipped")]
    assert cases[1]["message"] == "AssertionError: 335 != 188"
    per = contention.summarize([{"run": 1, "cases": cases}, {"run": 2, "cases": cases[:1]}])
    assert per["tests/test_x.py::test_ok"]["passed"] == 2
    assert per["tests/test_x.py::test_bad"]["failures"] == [{"run": 1, "message": "AssertionError: 335 != 188"}]
    assert "| `tests/test_x.py::test_bad` | 0 | 1 | 0 | 0 |" in contention.table(per)
    assert contention.parse_junit(tmp_path / "missing.xml") == []


def test_one_run_beside_a_burner(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "offload_bench", "contention", "--runs", "1", "--burners", "1",
                           "--burn", "cpu", "--python", sys.executable, "--out", str(out),
                           "--tests", "tests/unit/test_shared_auth.py::test_derive_mac_key"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["done"] == 1 and summary["burners"] == 1
    assert summary["per_test"]["tests/unit/test_shared_auth.py::test_derive_mac_key"]["passed"] == 1
    assert (out / "run-001" / "junit.xml").exists()


def test_bad_arguments_are_one_line_and_exit_2():
    for argv in (["--runs", "0"], ["--burners", "-1"], ["--tests", "tests/nope.py"], ["--bogus"],
                 ["--kv-trace", "maybe"]):
        proc = subprocess.run([sys.executable, "-m", "offload_bench", "contention", *argv], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, (argv, proc.stderr)


def test_resume_counts_the_runs_already_there(tmp_path):
    out = tmp_path / "out"
    base = [sys.executable, "-m", "offload_bench", "contention", "--burners", "0", "--python", sys.executable,
            "--out", str(out), "--tests", "tests/unit/test_shared_auth.py::test_derive_mac_key"]
    first = subprocess.run([*base, "--runs", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    again = subprocess.run([*base, "--runs", "2", "--resume"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["done"] == 2
    assert summary["per_test"]["tests/unit/test_shared_auth.py::test_derive_mac_key"]["passed"] == 2
    assert sorted(p.name for p in out.glob("run-*")) == ["run-001", "run-002"]
    # A clean run keeps what the summary needs (and its commit), not the engines' logs; the resumed summary reads
    # the earlier run's record back.
    record = json.loads((out / "run-001" / "run.json").read_text())
    assert record["rc"] == 0 and record["seconds"] > 0
    assert not (out / "run-001" / "engines").exists()
    assert [d["seconds"] for d in summary["run_details"]][0] == record["seconds"]
    other = subprocess.run([*base[:-1], "tests/unit/test_shared_auth.py", "--runs", "3", "--resume"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert other.returncode == 2 and "different --tests" in other.stderr, other.stderr
    untraced = subprocess.run([*base, "--runs", "3", "--resume", "--kv-trace", "off"], cwd=ROOT, capture_output=True,
                              text=True, timeout=60)
    assert untraced.returncode == 2 and "--kv-trace on, not off" in untraced.stderr, untraced.stderr
    assert summary["kv_trace"] == "on" and record["kv_trace"] is True
    (out / "summary.json").write_text("garbage{")
    broken = subprocess.run([*base, "--runs", "3", "--resume"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert broken.returncode == 2 and "cannot read" in broken.stderr and "Traceback" not in broken.stderr, broken.stderr


def test_kv_trace_off_runs_the_engines_without_the_trace(tmp_path, monkeypatch):
    """The trace's hashing changes the timing a race depends on, so `--kv-trace off` must really take it away, even
    when the caller's own environment has it set."""
    seen = tmp_path / "seen"
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho \"${{OC_KV_TRACE-unset}}\" >> {seen}\n")
    fake.chmod(0o755)
    monkeypatch.setenv("OC_KV_TRACE", "1")
    test = "tests/unit/test_shared_auth.py::test_derive_mac_key"
    off = contention.run_once(1, [test], tmp_path / "out", str(fake), 60, kv_trace=False)
    on = contention.run_once(2, [test], tmp_path / "out", str(fake), 60, kv_trace=True)
    assert seen.read_text().split() == ["unset", "1"]
    assert off["kv_trace"] is False and on["kv_trace"] is True


def test_engines_found_odd_by_their_control_are_counted_in_the_run_record(tmp_path):
    """An engine run again because its control request differed from the reference engines' (before anything was
    loaded) is noted by the tests under OC_ENGINE_LOG_DIR; the run's record carries every such note, so a series
    reports them beside its failures."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\nprintf \'{"kind": "connector", "rerun": true}\\n{"kind": "reference"}\\n\' '
                    '>> "$OC_ENGINE_LOG_DIR/odd-engines.jsonl"\n')
    fake.chmod(0o755)
    test = "tests/unit/test_shared_auth.py::test_derive_mac_key"
    rec = contention.run_once(1, [test], tmp_path / "out", str(fake), 60, kv_trace=False)
    assert [e["kind"] for e in rec["odd_engines"]] == ["connector", "reference"]
    assert json.loads((tmp_path / "out" / "run-001" / "run.json").read_text())["odd_engines"] == rec["odd_engines"]
    assert contention.odd_engines(tmp_path / "nowhere") == []


def test_the_default_selection_names_tests_that_exist():
    """The default is the selection the project's runs use (docs/results/contention/) and the equality tests added
    after it: every file and test function it names is there, so a rename cannot drop a test from it unseen."""
    assert "tests/engine/test_hybrid_engine.py" in contention.DEFAULT_TESTS
    for node in contention.DEFAULT_TESTS:
        path, _, name = node.partition("::")
        source = (ROOT / path).read_text()
        assert not name or f"def {name}(" in source, node
    main = json.loads((ROOT / "docs" / "results" / "contention" / "summary.json").read_text())["tests"]
    assert set(main) <= set(contention.DEFAULT_TESTS)
