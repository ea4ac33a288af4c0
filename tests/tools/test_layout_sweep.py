"""The layout sweep's own parts (offload-connector layout-sweep), without running a replay: the generated configs say
what their names say, the bounds flag what the issue's criteria exclude, the summary keeps the worst case."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from offload_bench.tools import layout_sweep as sweep

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("layout", sweep.LAYOUTS, ids=lambda lay: lay.name)
def test_generated_configs_match_their_names(layout, tmp_path) -> None:
    cfg = json.loads(sweep.write_config(layout, tmp_path).read_text())
    text = cfg.get("text_config", cfg)
    if layout.family == "gemma4":
        types = text["layer_types"]
        assert text["sliding_window"] == layout.window and len(types) == text["num_hidden_layers"]
        assert types.count("sliding_attention") == layout.per_full * types.count("full_attention")
    elif layout.family == "gpt-oss":
        assert text["sliding_window"] == layout.window
    elif layout.family == "llama4":
        assert text["attention_chunk_size"] == layout.window
    else:
        assert text["model_type"] == "deepseek_v4"


def _row(**kw):
    base = {"layout": "l", "workload": "w", "throughput": 1.0, "TTFT p50": 1.0, "TTFT p95": 1.0, "recomputed": 1.0,
            "recomputed_tokens": [10, 10], "stalls": [False, False], "completed": [1, 1, 1],
            "host_kib_per_cached_token": [1.0, 1.0]}
    row = {**base, **kw}
    return {**row, "outside": sweep.out_of_bounds(row)}


def test_bounds_and_worst_case() -> None:
    assert sweep.out_of_bounds(_row()) == []
    assert sweep.out_of_bounds(_row(throughput=0.998)) == ["throughput 0.9980"]
    assert sweep.out_of_bounds(_row(**{"TTFT p95": 1.02})) == ["TTFT p95 1.0200"]
    assert sweep.out_of_bounds(_row(recomputed=None, recomputed_tokens=[5, 0]))[0].startswith("recomputed: 5 tokens")
    assert sweep.out_of_bounds(_row(stalls=[True, False])) == ["stall"]
    rows = [_row(layout="a", recomputed=3.0), _row(layout="b", throughput=0.9),
            {"layout": "c", "workload": "w", "error": "exit 2: refused"}]
    s = sweep.summarize(rows)
    assert (s["cases"], s["finished"], s["errors"]) == (3, 2, 1) and len(s["outside"]) == 2
    assert s["worst"]["recomputed"]["layout"] == "a" and s["worst"]["throughput"]["layout"] == "b"


def test_host_bytes_without_spare_windows() -> None:
    cols = {"results": [
        {"connector": "offload", "output_tokens_per_s": 1.0, "ttft_p50_s": 1.0, "ttft_p95_s": 1.0,
         "tokens_recomputed": 0, "stalled": False, "requests_completed": 1, "requests_total": 1,
         "cpu_tier_bytes": 6 * 1024, "cpu_tier_cached_tokens": 2, "cpu_tier_bytes_per_cached_token": 3 * 1024,
         "extra": {"cpu_tier_spare_bytes": 2 * 1024, "cpu_tier_bytes_per_cached_token_without_spare": 2 * 1024}},
        {"connector": "vllm-offloading-patched", "output_tokens_per_s": 1.0, "ttft_p50_s": 1.0, "ttft_p95_s": 1.0,
         "tokens_recomputed": 0, "stalled": False, "requests_completed": 1, "requests_total": 1,
         "cpu_tier_bytes": 1024, "cpu_tier_cached_tokens": 1, "cpu_tier_bytes_per_cached_token": 1024,
         "extra": {"cpu_tier_bytes_per_cached_token_without_spare": 1024}}]}
    r = sweep.ratios(cols)
    assert r["host_kib_per_cached_token"] == [3.0, 1.0]
    assert r["host_kib_per_cached_token_without_spare"] == [2.0, 1.0]


def test_a_bad_argument_is_one_line_and_exit_2() -> None:
    for argv in (["--layouts", "nope"], ["--timeout", "nan"], ["--bogus"]):
        proc = subprocess.run([sys.executable, "-m", "offload_bench", "layout-sweep", *argv],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, (argv, proc.stderr)
