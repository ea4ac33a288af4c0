"""Replays through vLLM's real scheduler (Gemma-4-31B layout), kept small: a few hundred steps per connector."""

from __future__ import annotations

import json

import pytest

from offload_bench.cli import main
from offload_bench.replay.command import MODEL_DEFAULTS
from offload_bench.replay.runner import ReplayConfig, run_replay
from offload_bench.replay.table import header, render
from offload_bench.replay.timemodel import time_model_for
from offload_bench.replay.trace import parse_lines
from offload_bench.replay.workloads import Workload, gemma4_31b_returning

MODEL = "gemma-4-31b"


def _cfg(connectors: tuple[str, ...], **kw: object) -> ReplayConfig:
    base = dict(model=MODEL, connectors=connectors, num_gpu_blocks=2188, cpu_bytes=40 * 2**30,
                max_num_batched_tokens=1024, max_model_len=32768, max_num_seqs=64,
                time_model=time_model_for(MODEL))
    base.update(kw)
    return ReplayConfig(**base)  # type: ignore[arg-type]


def _line(t: float, n_in: int, n_out: int, ids: list[int]) -> str:
    return json.dumps({"timestamp": t, "input_length": n_in, "output_length": n_out, "hash_ids": ids})


def _returning_trace() -> list[str]:
    """Two 6,144-token prompts, 80k tokens of filler that push them out of the GPU prefix cache, then two prompts
    that start with them return (their shared prefixes end where the earlier prompts ended)."""
    lines = [_line(0, 6144, 4, list(range(12))), _line(100, 6144, 4, list(range(100, 112)))]
    lines += [_line(1000 + 200 * i, 8000, 2, list(range(1000 + 16 * i, 1016 + 16 * i))) for i in range(10)]
    lines += [_line(9000, 7000, 8, list(range(12)) + [500, 501]),
              _line(9000, 7000, 8, list(range(100, 112)) + [600, 601])]
    return lines


def test_every_connector_replays_a_mooncake_trace_and_ours_loads_the_shared_prefix() -> None:
    w = Workload("small", tuple(parse_lines(_returning_trace(), "small")), "")
    out = run_replay(w, _cfg(("offload", "offload-vllm-reservation", "vllm-offloading", "none")))
    res = {r.result.connector: r.result for r in out.runs}
    for r in res.values():
        assert not r.stalled and r.requests_completed == r.requests_total == 14, r
        assert r.output_tokens == 4 + 4 + 10 * 2 + 8 + 8
        assert r.simulated_seconds >= 9.0  # the last arrival is at 9 s
        # The last token comes at or before the end of the run (which waits for the connector's stores).
        assert 9.0 < r.extra["last_token_s"] <= r.simulated_seconds
        assert r.extra["output_tokens_per_s_to_last_token"] >= r.output_tokens_per_s
    # Each returning request shares 11 blocks of 512 with its first turn; the GPU cache no longer holds them.
    assert res["none"].tokens_loaded_from_cpu == 0 and res["none"].tokens_recomputed > 0
    for name in ("offload", "offload-vllm-reservation", "vllm-offloading"):
        assert res[name].tokens_loaded_from_cpu >= 2 * 6000, name
        assert res[name].tokens_recomputed < res["none"].tokens_recomputed, name
    assert res["offload"].transfer_bytes_stored > 0 and res["offload"].cpu_tier_bytes_per_cached_token
    # Spare windows are part of the tier's bytes, never more than them; vLLM's connector has none.
    assert 0 <= res["offload"].extra["cpu_tier_spare_bytes"] <= res["offload"].cpu_tier_bytes
    assert "cpu_tier_spare_bytes" not in res["vllm-offloading"].extra
    for r in (res["offload"], res["vllm-offloading"]):  # computed once, in the runner; without spare: none taken off
        spare = r.extra.get("cpu_tier_spare_bytes", 0)
        assert r.extra["cpu_tier_bytes_per_cached_token_without_spare"] == (
            (r.cpu_tier_bytes - spare) / r.cpu_tier_cached_tokens)
    text = render([r.result for r in out.runs])
    assert "tokens recomputed" in text and "vllm-offloading" in text and "without spare windows" in text
    assert "to the last output token" in text
    assert "step time" in header(out)
    json.dumps(out.to_json())


def test_burst_stalls_vllm_reservation_but_not_ours(tmp_path) -> None:
    """The k=2 cell of the built-in Gemma workload: two 20k contexts return in the same step."""
    full = gemma4_31b_returning(0)
    keep = [r for r in full.records
            if (r.session or "").startswith("burst-k2") or (r.get("phase") == "burst-filler"
                                                              and r.timestamp_ms < _return_time(full))]
    w = Workload("burst-k2", tuple(keep), "")
    out = run_replay(w, _cfg(("offload", "offload-vllm-reservation", "vllm-offloading"), stall_steps=50))
    res = {r.result.connector: r.result for r in out.runs}
    ours = res["offload"]
    assert not ours.stalled and ours.requests_completed == ours.requests_total
    assert ours.tokens_loaded_from_cpu >= 2 * 20 * 512 and ours.admission_deferrals > 0
    assert ours.extra["loads_content_checked"] >= 2  # every landed load was compared with what was stored
    for name in ("offload-vllm-reservation", "vllm-offloading"):
        r = res[name]
        assert r.stalled and r.requests_completed < r.requests_total, name
        dump = r.stall_dump
        assert dump is not None and dump["held_by_running"] == 0 and dump["top_holders"]
    from offload_bench.replay.plots import plot

    png = plot(out, tmp_path / "burst.png")
    assert png.stat().st_size > 10_000


def _return_time(w: Workload) -> float:
    return min(r.timestamp_ms for r in w.records if r.get("phase") == "burst-k2")


def test_cli_replays_a_file_and_reports_a_malformed_line(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(_returning_trace()[:3]) + "\n")
    js = tmp_path / "r.json"
    rc = main(["replay", "--trace", str(trace), "--connectors", "offload,none", "--json", str(js), "--no-progress"])
    assert rc == 0
    data = json.loads(js.read_text())
    assert [r["connector"] for r in data["results"]] == ["offload", "none"]
    assert all(r["requests_completed"] == 3 and not r["stalled"] for r in data["results"])
    assert data["config"]["time_model"]["bandwidth_gbps"] == 50.0
    bad = tmp_path / "bad.jsonl"
    bad.write_text(_line(0, 600, 1, [1, 2]) + "\n" + json.dumps({"timestamp": 1, "input_length": 600,
                                                                   "output_length": 1, "hash_ids": [1]}) + "\n")
    assert main(["replay", "--trace", str(bad), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "line 2" in err and "'hash_ids'" in err
    assert main(["replay", "--connectors", "offload,bogus", "--no-progress"]) == 2
    assert "bogus" in capsys.readouterr().err


def test_cli_defaults_to_the_workloads_model_and_replays_gpt_oss(tmp_path) -> None:
    """`--trace agent-tool-prefix` alone replays on the model the workload was sized for (gpt-oss-20b: two groups,
    window 128, block 16), and its later agent turns load their sessions from the CPU tier."""
    js = tmp_path / "r.json"
    rc = main(["replay", "--trace", "agent-tool-prefix", "--limit", "40",
               "--connectors", "offload,vllm-offloading,none", "--json", str(js), "--no-progress"])
    assert rc == 0
    data = json.loads(js.read_text())
    cfg = data["config"]
    assert cfg["model"] == "gpt-oss-20b" and cfg["max_model_len"] == 32768
    assert cfg["num_gpu_blocks"] == MODEL_DEFAULTS["gpt-oss-20b"].num_gpu_blocks
    assert cfg["time_model"]["basis"].startswith("gpt-oss-20b")
    res = {r["connector"]: r for r in data["results"]}
    for r in res.values():
        assert not r["stalled"] and r["requests_completed"] == r["requests_total"] == 40, r["connector"]
        assert len(r["extra"]["groups"]) == 2
    assert res["none"]["tokens_loaded_from_cpu"] == 0
    for name in ("offload", "vllm-offloading"):
        assert res[name]["tokens_loaded_from_cpu"] > 0, name
        assert res[name]["tokens_recomputed"] < res["none"]["tokens_recomputed"], name


@pytest.mark.parametrize("text, needle", [
    ('{"nope": 1}', "unknown key(s) ['nope']"),
    ('{"window_checkpoint_tokens": -1}', "'window_checkpoint_tokens' must be a positive integer"),
    ('[1', "not JSON"),
    ('[1]', "must be a JSON object"),
    ('{"cpu_bytes": 5}', "set by --cpu-bytes"),
])
def test_cli_offload_config_is_checked_before_the_run(text, needle, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["replay", "--offload-config", text, "--no-progress"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def _mid_prompt() -> Workload:
    first = list(range(24))
    lines = [_line(0, 12288, 4, first)]
    lines += [_line(1000 + 200 * i, 8000, 2, list(range(1000 + 16 * i, 1016 + 16 * i))) for i in range(10)]
    lines += [_line(9000, 10240, 4, first[:18] + [500, 501]), _line(12000, 10240, 4, first[:18] + [600, 601])]
    return Workload("mid-prompt", tuple(parse_lines(lines, "mid")), "")


def test_ours_resumes_a_prefix_shared_up_to_a_point_inside_an_earlier_prompt() -> None:
    """A 12,288-token prompt, filler, then two requests sharing its first 9,216 tokens (a point inside it). Without
    spare windows the first resumes at the 8,192-token checkpoint; it computes through 9,216 and stores the window
    there (a junction), so the second resumes at 9,216 (from the GPU prefix cache, which keeps the window at the
    junction too). With them (the default) the same under pressure; with room both resume at 9,216 from the tier."""
    # Checkpoints every 8,192 tokens, as set (the spacing derived for this layout is 10,240: no checkpoint below
    # the shared 9,216 at all, which test_derived_spacing_resumes_at_the_junction_the_first_request_left covers).
    pinned = (("window_checkpoint_tokens", 8192),)
    out = run_replay(_mid_prompt(), _cfg(("offload", "none"), offload_extra=(("spare_windows", False), *pinned)))
    res = {r.result.connector: r.result for r in out.runs}
    assert not res["offload"].stalled and res["offload"].requests_completed == 13
    # vLLM takes the junction as the first one's `shared_prefix_boundary` and caches the window at 9,216 in the GPU
    # prefix cache as well: the second then resumes there from the GPU, loading nothing from the CPU tier.
    assert res["offload"].tokens_loaded_from_cpu == 8192
    # With them: the 40 GiB tier is under pressure (the filler alone is 80k tokens at about 880 KiB each), so the
    # spare windows of the first prompt are evicted before anything else and nothing changes; in a tier with room for
    # the whole trace both resume at 9,216 from the tier (no junction forms, so the GPU keeps no window there).
    for cpu_bytes, loaded in ((40 * 2**30, 8192), (160 * 2**30, 2 * 9216)):
        spare = run_replay(_mid_prompt(), _cfg(("offload",), cpu_bytes=cpu_bytes, offload_extra=pinned)).runs[0].result
        assert not spare.stalled and spare.tokens_loaded_from_cpu == loaded, cpu_bytes
    assert res["offload"].tokens_recomputed < res["none"].tokens_recomputed


def test_derived_spacing_resumes_at_the_junction_the_first_request_left() -> None:
    """The same trace with the spacing derived from Gemma 4 31B's layout (10,240 tokens: five 1,024-token windows
    weigh as much as 10,240 tokens of its full-attention KV) and no spare windows: no checkpoint lies below the shared
    9,216 tokens, so the first returning request finds the full-attention prefix without a window and recomputes it,
    marking the junction; the second resumes there (from the GPU prefix cache, as above)."""
    out = run_replay(_mid_prompt(), _cfg(("offload", "none"), offload_extra=(("spare_windows", False),)))
    res = {r.result.connector: r.result for r in out.runs}
    assert not res["offload"].stalled and res["offload"].requests_completed == 13
    assert res["offload"].tokens_loaded_from_cpu == 0
    assert res["offload"].tokens_recomputed < res["none"].tokens_recomputed
