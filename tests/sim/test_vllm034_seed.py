"""The reason this connector exists, on vLLM 0.34 at its own default block size (64): the seed stall.

0.34 lays Gemma 4 31B out in blocks of 64 and 128 tokens instead of 16 and 32, so the seed's 2,188 blocks would hold
four times the tokens and no longer press the pool; the same pool in bytes (547 blocks) does. vLLM's reservation
(its capped `_request_remaining_blocks`, now also cached for parked loads) admits both loads and the engine stalls;
the exact ledger defers the second and both complete."""

from __future__ import annotations

import pytest

from offload_bench.sim.layouts import BLOCK_SIZE_ENV
from tests.sim.test_async_load_hooks import needs_034


@pytest.fixture(scope="module")
def results():
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(BLOCK_SIZE_ENV, raising=False)  # 0.34's default, whatever the suite pins
        from offload_bench.sim.scenarios import GEMMA4_SEED, run_stall_scenario
        return {mode: run_stall_scenario(GEMMA4_SEED, mode) for mode in ("vllm", "exact")}


@needs_034
def test_the_seed_pool_in_bytes_stalls_vllms_reservation_on_034(results) -> None:
    r = results["vllm"]
    assert r.num_blocks == 547  # 2,188 blocks of 16 tokens, in blocks of 64
    assert r.stalled and r.returning_completed == 0
    assert r.loaded_tokens == 2 * 21_888  # the hit is aligned to 128 tokens on 0.34
    assert r.free_blocks_end == 44


@needs_034
def test_the_exact_ledger_completes_it_on_034(results) -> None:
    r = results["exact"]
    assert not r.stalled and r.returning_completed == 2 and r.pool_drained
    assert r.deferrals > 0 and r.loaded_tokens == 2 * 21_888


@needs_034
def test_the_replay_runs_with_the_inflight_load_cap() -> None:
    """`offload-connector replay --max-num-inflight-kv-loads N` sets vLLM 0.34's cap on the engines it builds: the
    scheduler reads it, and a short replay with it completes every request in both columns without a stall."""
    import json
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        proc = subprocess.run([sys.executable, "-m", "offload_bench", "replay", "--trace", "agent-tool-prefix",
                               "--limit", "12", "--max-num-inflight-kv-loads", "1", "--connectors",
                               "offload,vllm-offloading-patched", "--no-progress", "--json", str(out)],
                              cwd=root, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-2000:]
        data = json.loads(out.read_text())
    assert data["config"]["max_num_inflight_kv_loads"] == 1
    for col in data["results"]:
        assert not col["stalled"] and col["requests_completed"] == col["requests_total"] == 12, col
