"""offload-connector disk-bench runs end to end at a tiny size: both bandwidth passes and the read-back latency pass
(every read-back's bytes are checked inside the bench, which raises on a mismatch), and bad arguments end it with
one line and exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "offload_bench", "disk-bench", *args], capture_output=True, text=True,
                          timeout=300)


def test_tiny_run_reports_read_back_latency_idle_and_under_writes(tmp_path):
    p = _run("--dir", str(tmp_path), "--total-mib", "16", "--slot-bytes", "262144", "--repeat", "1",
             "--load-blocks", "4", "--loads", "3", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    rb = out["read_back"]
    assert rb["load_blocks"] == 4 and rb["loads"] == 3 and rb["read_set_slots"] == 32
    assert len(rb["idle_s"]) == 3 and len(rb["loaded_s"]) == 3
    assert all(t > 0 for t in rb["idle_s"] + rb["loaded_s"])
    assert rb["writer"]["slots"] > 0 and rb["writer"]["failed"] == 0
    assert out["store_stats"]["corrupt_dropped"] == 0
    assert list(tmp_path.iterdir()) == []  # the bench removes what it wrote


def test_bad_arguments_exit_2_with_one_line(tmp_path):
    for args in (("--loads", "0"), ("--load-blocks", "-1"), ("--dir", str(tmp_path / "missing"))):
        p = _run(*args)
        assert p.returncode == 2, (args, p.stdout, p.stderr)
        assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
