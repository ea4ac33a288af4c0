"""Per-phase figures of a replay: each request's loads, recompute and TTFT grouped by the phase its record names,
adding up to the run's totals, in the JSON and in the printed table."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from offload_bench.cli import main
from offload_bench.replay.metrics import MAX_PHASES, OTHER_PHASE, Recorder
from offload_bench.replay.runner import ReplayConfig, record_phase, run_replay
from offload_bench.replay.table import render_phases
from offload_bench.replay.timemodel import time_model_for
from offload_bench.replay.trace import parse_lines
from offload_bench.replay.workloads import Workload

MODEL = "gemma-4-31b"


def _line(t: float, n_in: int, n_out: int, ids: list[int], **extra: object) -> str:
    return json.dumps({"timestamp": t, "input_length": n_in, "output_length": n_out, "hash_ids": ids, **extra})


def _trace() -> list[str]:
    """A 6,144-token first turn, filler that pushes it out of the GPU prefix cache, then its follow-up."""
    lines = [_line(0, 6144, 4, list(range(12)), phase="chat")]
    lines += [_line(1000 + 200 * i, 8000, 2, list(range(1000 + 16 * i, 1016 + 16 * i)), phase="filler")
              for i in range(10)]
    lines += [_line(9000, 7000, 8, list(range(12)) + [500, 501], phase="follow-up")]
    return lines


def test_phase_figures_add_up_to_the_totals_and_show_where_the_loads_went() -> None:
    w = Workload("phased", tuple(parse_lines(_trace(), "phased")), "")
    cfg = ReplayConfig(model=MODEL, connectors=("offload", "none"), num_gpu_blocks=2188, cpu_bytes=40 * 2**30,
                       max_num_batched_tokens=1024, max_model_len=32768, max_num_seqs=64,
                       time_model=time_model_for(MODEL))
    out = run_replay(w, cfg)
    res = {r.result.connector: r.result for r in out.runs}
    for r in res.values():
        phases = r.per_phase
        assert set(phases) == {"chat", "filler", "follow-up"}
        assert [phases[p]["requests"] for p in ("chat", "filler", "follow-up")] == [1, 10, 1]
        assert sum(f["loaded_tokens"] for f in phases.values()) == r.tokens_loaded_from_cpu
        assert sum(f["recomputed_tokens"] for f in phases.values()) == r.tokens_recomputed
        assert sum(f["prompt_tokens"] for f in phases.values()) == 6144 + 10 * 8000 + 7000
        assert all(f["ttft_p50_s"] is not None and f["ttft_p95_s"] >= f["ttft_p50_s"] for f in phases.values())
    # The follow-up is the only request with anything to reuse, and only ours brings it back from the CPU tier.
    ours, none = res["offload"].per_phase, res["none"].per_phase
    assert ours["follow-up"]["loaded_tokens"] >= 6000 and ours["follow-up"]["recomputed_tokens"] == 0
    assert none["follow-up"]["loaded_tokens"] == 0 and none["follow-up"]["recomputed_tokens"] >= 6000
    assert ours["chat"]["loaded_tokens"] == ours["filler"]["loaded_tokens"] == 0
    text = render_phases([res["offload"], res["none"]])
    row = next(line for line in text.splitlines() if line.startswith("follow-up"))
    assert f"{ours['follow-up']['loaded_tokens']:,} / 0 / " in row
    assert f"0 / {none['follow-up']['recomputed_tokens']:,} / " in row
    json.dumps(out.to_json())


def test_record_phase_falls_back_to_the_turn_and_ignores_what_is_not_a_string() -> None:
    recs = parse_lines([_line(0, 512, 1, [1], phase="rag"), _line(1, 512, 1, [2], session="s", turn=0),
                        _line(2, 1024, 1, [2, 3], session="s", turn=1), _line(3, 512, 1, [4], phase=["x"]),
                        _line(4, 512, 1, [5])], "t")
    assert [record_phase(r) for r in recs] == ["rag", "first turn", "later turn", "", ""]


def test_phase_labels_are_bounded_in_number_and_length() -> None:
    rec = Recorder(512, ["g0"], 100)
    for i in range(MAX_PHASES + 5):
        rec.on_arrival(SimpleNamespace(request_id=f"r{i}", block_hashes=[], num_prompt_tokens=10), 0.0,
                       f"p{i}" + "x" * 100)
    labels = {r.phase for r in rec.reqs.values()}
    assert len(labels) == MAX_PHASES + 1 and OTHER_PHASE in labels
    assert max(len(p) for p in labels) == 40
    assert sum(f["requests"] for f in rec.per_phase().values()) == MAX_PHASES + 5


def test_phase_labels_from_a_file_cannot_break_the_terminal_table() -> None:
    rec = Recorder(512, ["g0"], 100)
    rec.on_arrival(SimpleNamespace(request_id="r0", block_hashes=[], num_prompt_tokens=10), 0.0, "a\nb\x1b[2Jc")
    assert list(rec.per_phase()) == ["a?b?[2Jc"]


def test_no_phase_no_section() -> None:
    rec = Recorder(512, ["g0"], 100)
    rec.on_arrival(SimpleNamespace(request_id="r0", block_hashes=[], num_prompt_tokens=10), 0.0)
    assert rec.per_phase() == {}


@pytest.mark.parametrize("phase", ["rag", 7])
def test_cli_prints_the_phase_table_for_a_trace_with_phases(tmp_path, capsys: pytest.CaptureFixture[str],
                                                           phase: object) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(_line(i * 100.0, 1024, 2, [10 * i, 10 * i + 1], phase=phase) for i in range(3)))
    assert main(["replay", "--trace", str(path), "--model", MODEL, "--connectors", "offload,none",
                 "--no-progress", "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert ("per phase:" in out) == isinstance(phase, str)
    got = json.load(open(tmp_path / "r.json"))["results"][0]["per_phase"]
    assert (list(got) == ["rag"]) if isinstance(phase, str) else got == {}
