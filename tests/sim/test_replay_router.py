"""Two engines behind a round-robin router (issue 13): the shared tier loads what another engine computed, which
private CPU tiers recompute. Reduced: the first 40 requests of the built-in agent-tool-prefix workload (about half a
minute for both columns)."""

from __future__ import annotations

import pytest

from offload_bench.cli import main
from offload_bench.replay.router import PRIVATE, SHARED, RouterConfig, header, render, run_router
from offload_bench.replay.timemodel import time_model_for
from offload_bench.replay.workloads import agent_tool_prefix
from offload_bench.sim.remote import SimPool, SimSharedStore, TAG_VALUE_BYTES, decode_tag, encode_tag

MODEL = "gpt-oss-20b"


@pytest.fixture(scope="module")
def reduced():
    cfg = RouterConfig(model=MODEL, num_gpu_blocks=2304, cpu_bytes=8 * 2**30, max_num_batched_tokens=1024,
                       max_model_len=32768, max_num_seqs=64, time_model=time_model_for(MODEL), limit=40,
                       stall_steps=100)
    return run_router(agent_tool_prefix(0), cfg)


def test_shared_tier_loads_what_private_tiers_recompute(reduced):
    res = {r.result.connector: r.result for r in reduced.runs}
    private, shared = res[PRIVATE], res[SHARED]
    for r in (private, shared):
        assert not r.stalled and r.first_stall_step is None, r.stopped_reason
        assert r.requests_completed == r.requests_total == 40
        assert r.extra["per_engine_requests"] == [20, 20] and r.extra["per_engine_completed"] == [20, 20]
        assert r.extra["loads_content_checked"] > 0  # every landed load held its own tokens' tags
    assert private.extra["tokens_loaded_from_shared"] is None
    assert shared.extra["tokens_loaded_from_shared"] > 0
    assert shared.tokens_recomputed < private.tokens_recomputed
    # What came from the shared tier went through the store: written once every worker reported, fetched by the other
    # engine, never refused or mismatched.
    assert shared.extra["shared_blocks_written"] > 0 and shared.extra["shared_blocks_fetched"] > 0
    assert shared.extra["shared_fetch_failures"] == 0 and shared.extra["shared_put_tag_mismatches"] == 0
    assert shared.extra["shared_bytes_fetched"] > 0
    # Admission stays exact whichever tier a load reads from: every admission's predicted blocks per group are what
    # vLLM allocated (recorded admissions, as in the ledger fuzz).
    for r in (private, shared):
        assert r.extra["admissions_checked"] > 0 and r.extra["admission_mismatches"] == 0
    # Host bytes per cached token without spare windows: every engine's spare windows taken off the pool's bytes
    # (none here: on gpt-oss-20b the checkpoints, one 128-token window every 128 tokens, already hold every block).
    for r in (private, shared):
        spare = r.extra["cpu_tier_spare_bytes"]
        assert 0 <= spare < r.cpu_tier_bytes
        assert r.extra["cpu_tier_bytes_per_cached_token_without_spare"] == pytest.approx(
            (r.cpu_tier_bytes - spare) / r.cpu_tier_cached_tokens)
    text = render([r.result for r in reduced.runs])
    assert "from the shared tier" in text and SHARED in text and "without spare windows" in text
    assert "2 engines, round-robin" in header(reduced) and "10 GB/s" in header(reduced)


def test_landing_check_covers_blocks_fetched_from_the_shared_tier(monkeypatch):
    """A fetch that puts the wrong tags into its CPU-tier slots (here: every fetched block claims another block's
    tokens) is caught by the driver when the load lands, as a wrong CPU-tier copy would be."""
    import offload_bench.sim.remote as sim_remote
    from offload_bench.replay.router import run_column
    from offload_bench.sim.driver import LoadContentError

    real = sim_remote.decode_tag
    monkeypatch.setattr(sim_remote, "decode_tag", lambda value: (real(value)[0], b"not this block"))
    cfg = RouterConfig(model=MODEL, num_gpu_blocks=2304, cpu_bytes=8 * 2**30, max_num_batched_tokens=1024,
                       max_model_len=32768, max_num_seqs=64, time_model=time_model_for(MODEL), stall_steps=100)
    with pytest.raises(LoadContentError, match="after load"):
        run_column(SHARED, agent_tool_prefix(0).records[:12], cfg)  # request 9 is the first shared-tier load


def test_sim_store_round_trips_tags_under_the_real_framing():
    from offload_connector.remote import RemoteFingerprint

    pool = SimPool()
    fp = RemoteFingerprint(model="m", layout="oc-slot", dtype="bf16", group_block_bytes=(4096,), block_sizes=(16,))
    a, b = SimSharedStore(fp, pool), SimSharedStore(fp, pool)
    key = (0, b"\x01" * 32)
    assert a.put([key], [encode_tag(key)]) == [True]
    out = bytearray(TAG_VALUE_BYTES)
    assert b.get([key], [out]) == [True] and decode_tag(out) == key  # another client (engine) reads it
    other = SimSharedStore(RemoteFingerprint(**{**fp.__dict__, "tp_rank": 1, "tp_size": 2}), pool)
    assert other.get([key], [bytearray(TAG_VALUE_BYTES)]) == [False]  # another shard's key space


@pytest.mark.parametrize("argv, message", [
    (["--router", "round-robin"], "--router needs --engines 2 or more"),
    (["--engines", "2", "--connectors", "none"], "--connectors must be offload or left out"),
    (["--engines", "2", "--plot", "x.png"], "--plot is not available with --engines 2"),
    (["--engines", "2", "--shared-latency-ms", "-1"], "argument --shared-latency-ms"),
])
def test_router_arguments_are_one_line_errors(argv, message, capsys):
    try:
        rc = main(["replay", "--no-progress", *argv])
    except SystemExit as exc:  # argparse's own checks (ranges) exit from the parser
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err and len(err.strip().splitlines()) == 1
