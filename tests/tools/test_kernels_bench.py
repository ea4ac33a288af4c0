"""The benchmark harnesses run end to end on CPU and their verification catches wrong bytes (no timing asserted)."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    return importlib.import_module(f"offload_bench.tools.{name}")


@pytest.fixture(scope="module")
def tb():
    return _load("transfer_bench")


def test_transfer_bench_cpu_smoke_writes_verified_results(tb, tmp_path):
    args = ["--out", str(tmp_path), "--cpu-smoke", "--pages", "4096,12288", "--blocks", "3,40,9000",
            "--pool-gib", str(32 / 1024), "--peak-mib", "1"]
    assert tb.main(args) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    md = (tmp_path / "results.md").read_text()
    assert res["complete"] and res["targets"]["all verified"] is True
    assert {(r["page_bytes"], r["blocks"], r["direction"]) for r in res["matrix"]} == {
        (p, n, d) for p in (4096, 12288) for n in (3, 40) for d in ("h2d", "d2h")}
    assert all(r["verified"] and r["method"] == "reference" and r["gbps"] > 0 for r in res["matrix"])
    assert set(res["peak"]) == {"h2d", "d2h"}
    assert any("9000 blocks: exceeds" in s for s in res["skipped"])
    assert "| h2d | 4 KiB | 3 | reference |" in md
    # The Gemma-shaped stage: 60 tensors in two groups, both directions, block-first host slots (2 rows here).
    assert [(r["direction"], r["pages"], r["verified"]) for r in res["layout"]] == [("h2d", 50 + 20, True),
                                                                                  ("d2h", 50 + 20, True)]


def test_transfer_bench_verification_catches_a_wrong_copy(tb):
    cfg = tb.parse_args(["--out", "/nonexistent", "--cpu-smoke", "--pool-gib", str(1 / 1024), "--peak-mib", "1"])
    res = tb.Results()
    pools = tb.Pools(cfg, torch.device("cpu"), res)
    dev, host, rows = pools.views(4096)
    host_ids, dev_ids = np.array([1, 2]), np.array([5, 7])
    # Right pages, then one wrong byte in a copied page, then a stray write to an untouched page.
    dev[5], dev[7] = host[1], host[2]
    assert pools.verify("h2d", 4096, host_ids, dev_ids)
    dev[5], dev[7] = host[1], host[2]
    dev[7, 100] ^= 1
    assert not pools.verify("h2d", 4096, host_ids, dev_ids)
    dev[5], dev[7] = host[1], host[2]
    dev[9, 0] ^= 1
    assert not pools.verify("h2d", 4096, host_ids, dev_ids)
    pools.dev.copy_(pools.dev_golden)
    host[3] = dev[4]
    host[0, 0] ^= 1
    assert not pools.verify("d2h", 4096, np.array([3]), np.array([4]))
    host[3] = dev[4]
    assert pools.verify("d2h", 4096, np.array([3]), np.array([4]))
    pools.close()


def test_transfer_bench_argument_errors(tb, capsys):
    with pytest.raises(SystemExit):
        tb.parse_args(["--out", "x", "--methods", "kernel,warp"])
    assert "unknown ['warp']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tb.parse_args(["--out", "x", "--cpu-smoke", "--methods", "kernel"])
    with pytest.raises(SystemExit):
        tb.parse_args(["--out", "x", "--pages", "0"])
    cfg = tb.parse_args(["--out", "x"])
    assert cfg.pages == (16384, 65536, 262144, 2621440) and cfg.blocks[-1] == 10000
    assert cfg.methods == ("kernel", "batch", "batch_any", "per_page") and cfg.budget_s == 300


def test_cpu_copy_bench_runs_and_verifies(tmp_path):
    cb = _load("cpu_copy_bench")
    out = tmp_path / "rows.json"
    assert cb.main(["--pages", "4096,20000", "--total-mib", "1", "--tensors", "2", "--repeats", "2",
                    "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert len(rows) == 4
    for r in rows:
        assert r["host_verified"] and r["reference_verified"], r
        assert r["host_ratio_to_large_copy"] > 0 and r["reference_ratio_to_large_copy"] > 0
        assert r["isa"] in ("memcpy", "sse2", "avx2", "avx512")
    assert cb.main(["--pages", "4096", "--total-mib", "1", "--tensors", "2", "--repeats", "1", "--isa", "memcpy",
                    "--json", str(out)]) == 0
    assert {r["isa"] for r in json.loads(out.read_text())} == {"memcpy"}


def test_overlap_bench_cpu_smoke_verifies_and_catches_a_wrong_copy(tmp_path, monkeypatch):
    ob = _load("overlap_bench")
    assert ob.main(["--out", str(tmp_path / "ok"), "--cpu-smoke", "--copies", "2"]) == 0
    res = json.loads((tmp_path / "ok" / "results.json").read_text())
    assert [(r["backend"], r["direction"], r["compute"]) for r in res["rows"]] == [
        ("reference", d, c) for d in ("h2d", "d2h") for c in ("matmul", "stream")]
    assert all(r["verified"] and r["copy_gbps_alone"] > 0 and r["compute_calls"] >= 1 for r in res["rows"])
    assert "| reference | h2d | matmul |" in (tmp_path / "ok" / "results.md").read_text()

    from offload_connector.kernels import Completion

    class CopiesNothing:
        def copy(self, direction, ids, stream=None):
            return Completion()

        def close(self):
            pass

    # Bad arguments: one line, exit 2 (argparse for the numbers; a file where the directory should be).
    for bad in (["--copies", "0"], ["--copies", "1001"], ["--copies", "x"]):
        with pytest.raises(SystemExit) as exit_:
            ob.parse_args(["--out", str(tmp_path), *bad])
        assert exit_.value.code == 2
    (tmp_path / "a-file").write_text("")
    assert ob.main(["--out", str(tmp_path / "a-file"), "--cpu-smoke"]) == 2

    monkeypatch.setattr(ob, "make_copier", lambda *a, **k: CopiesNothing())
    assert ob.main(["--out", str(tmp_path / "bad"), "--cpu-smoke", "--copies", "1"]) == 1
    res = json.loads((tmp_path / "bad" / "results.json").read_text())
    assert not any(r["verified"] for r in res["rows"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_gpu_check_refuses_cleanly_without_a_gpu(tmp_path):
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check"), str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 2, proc.stderr
    assert "[gpu-check] FAIL: no CUDA device visible to torch" in proc.stderr
    assert not (tmp_path / "out" / "bench").exists()
