"""Replay inputs: Mooncake-format parsing and validation, prompt derivation, built-in workloads, CLI arguments."""

from __future__ import annotations

import gzip
import json

import pytest

from offload_bench.args import parse_bytes
from offload_bench.replay.command import MODEL_DEFAULTS
from offload_bench.replay.timemodel import SimClock, TimeModel, time_model_for
from offload_bench.replay.trace import (
    SAMPLED_TOKEN,
    PromptBuilder,
    TraceError,
    clip_to_model,
    load_trace,
    parse_lines,
    prompt_tokens,
)
from offload_bench.replay.workloads import BUILTIN, resolve_trace

GENERATED = ["gemma4-31b-returning", "deepseek-v4-flash-1m", "deepseek-v4-flash-pp-mtp", "agent-tool-prefix",
             "rag-shared-docs", "decode-heavy"]
REUSE = ["agent-tool-prefix", "rag-shared-docs", "decode-heavy"]


def _line(**kw: object) -> str:
    rec = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}
    rec.update(kw)
    return json.dumps({k: v for k, v in rec.items() if v is not None})


@pytest.mark.parametrize("bad, field", [
    (dict(timestamp=-1), "timestamp"),
    (dict(timestamp="soon"), "timestamp"),
    (dict(input_length=0), "input_length"),
    (dict(input_length=1.5), "input_length"),
    (dict(output_length=0), "output_length"),
    (dict(hash_ids=[1, "x"]), "hash_ids"),
    (dict(hash_ids=[1]), "hash_ids"),  # 600 tokens need 2 ids of 512
    (dict(hash_ids=[1, 2, 3]), "hash_ids"),
])
def test_malformed_line_names_line_and_field(bad: dict, field: str) -> None:
    lines = [_line(), _line(timestamp=5), _line(**bad)]
    with pytest.raises(TraceError) as err:
        parse_lines(lines, "t.jsonl")
    assert "t.jsonl line 3" in str(err.value) and f"'{field}'" in str(err.value)


def test_missing_field_and_bad_json_name_the_line() -> None:
    with pytest.raises(TraceError, match=r"line 2: missing field 'hash_ids'"):
        parse_lines([_line(), json.dumps({"timestamp": 1, "input_length": 3, "output_length": 1})])
    with pytest.raises(TraceError, match=r"line 1: not valid JSON"):
        parse_lines(["{oops"])
    with pytest.raises(TraceError, match=r"no requests"):
        parse_lines(["", "  "])


def test_sessions_must_chain(tmp_path) -> None:
    ok = [_line(session="a", turn=0), _line(timestamp=9, input_length=1100, hash_ids=[1, 2, 3], session="a", turn=1)]
    assert [r.turn for r in parse_lines(ok)] == [0, 1]
    with pytest.raises(TraceError, match=r"line 1: field 'turn' is 1 but turn 0"):
        parse_lines([_line(session="a", turn=1)])
    with pytest.raises(TraceError, match=r"line 2: field 'input_length'"):
        parse_lines([_line(session="a", turn=0), _line(timestamp=1, session="a", turn=1)])
    with pytest.raises(TraceError, match=r"'session' and 'turn' go together"):
        parse_lines([_line(session="a")])


def test_load_gz_sorts_by_time_and_keeps_extra_fields(tmp_path) -> None:
    p = tmp_path / "t.jsonl.gz"
    with gzip.open(p, "wt") as fh:
        fh.write(_line(timestamp=7, chat="x") + "\n\n" + _line(timestamp=3) + "\n")
    recs = load_trace(p)
    assert [r.timestamp_ms for r in recs] == [3.0, 7.0]
    assert recs[1].get("chat") == "x" and recs[1].line == 1


def test_shared_hash_ids_give_shared_token_prefixes() -> None:
    a = prompt_tokens([10, 11, 12], 1100, seed=0)
    b = prompt_tokens([10, 11, 99], 1300, seed=0)
    assert len(a) == 1100 and len(b) == 1300
    assert a[:1024] == b[:1024] and a[1024:1100] != b[1024:1100]
    assert prompt_tokens([10], 300, seed=1) != a[:300]  # the seed changes the expansion


def test_next_turn_resumes_after_the_previous_answer() -> None:
    recs = parse_lines([_line(session="s", turn=0, output_length=4),
                        _line(timestamp=1, input_length=700, hash_ids=[1, 5], session="s", turn=1)])
    pb = PromptBuilder(seed=0)
    first = pb.build(recs[0], 600, 4)
    second = pb.build(recs[1], 700, 4)
    assert second[:604] == first + [SAMPLED_TOKEN] * 4 and len(second) == 700


def test_clip_keeps_the_prefix() -> None:
    rec = parse_lines([_line(input_length=5000, hash_ids=list(range(10)), output_length=900)])[0]
    c = clip_to_model(rec, 4096)
    assert c.clipped and c.input_length + c.output_length <= 4096 and c.output_length == 900


def test_every_builtin_is_enumerated() -> None:
    assert set(BUILTIN) == set(GENERATED) | {"mooncake-synthetic"}


@pytest.mark.parametrize("name", GENERATED)
def test_generated_workloads_are_deterministic_and_valid(name: str) -> None:
    a, b, c = BUILTIN[name](0), BUILTIN[name](0), BUILTIN[name](1)
    assert a.records == b.records and a.records != c.records
    assert a.name == name and a.description.strip() and a.default_model in MODEL_DEFAULTS
    # Round trip through the Mooncake loader (the session chain is checked there too).
    lines = [json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                         "output_length": r.output_length, "hash_ids": list(r.hash_ids),
                         "session": r.session, "turn": r.turn}) for r in a.records]
    assert len(parse_lines(lines)) == len(a.records)


@pytest.mark.parametrize("name", ["gemma4-31b-returning", "deepseek-v4-flash-1m"])
def test_admission_workloads_have_their_burst_cells(name: str) -> None:
    a = BUILTIN[name](0)
    phases = {r.get("phase") for r in a.records}
    assert {"burst-k2", "burst-k3", "burst-k4", "edge"} <= phases  # issue 4: burst sweep of 2-4, an edge case
    for k in (2, 3, 4):  # k distinct sessions, each resuming a previous turn, all in the same step
        cell = [r for r in a.records if r.get("phase") == f"burst-k{k}"]
        assert len(cell) == len({r.session for r in cell}) == k and len({r.timestamp_ms for r in cell}) == 1
        assert all(r.turn and r.turn >= 1 for r in cell)


def _mid_prompt_sharers(records) -> int:
    """Requests whose longest shared hash-id prefix (4+ blocks) with an earlier request ends inside both prompts."""
    n = 0
    for i, r in enumerate(records):
        if r.turn:  # later turns resume after their own previous answer; that reuse ends at a prompt's end
            continue
        best, inside = 0, False
        for e in records[:i]:
            k = 0
            for x, y in zip(r.hash_ids, e.hash_ids):
                if x != y:
                    break
                k += 1
            if k > best or (k == best and k < len(e.hash_ids)):
                best, inside = k, k < len(e.hash_ids) and k < len(r.hash_ids)
        n += best >= 4 and inside
    return n


@pytest.mark.parametrize("name", REUSE)
def test_reuse_workloads_share_prefixes_that_end_mid_prompt(name: str) -> None:
    w = BUILTIN[name](0)
    recs = w.records
    # Nothing is clipped on the 32k-context models every built-in workload must run on.
    for model in ("gemma-4-31b", "gpt-oss-20b"):
        limit = MODEL_DEFAULTS[model].max_model_len
        assert all(not clip_to_model(r, limit).clipped for r in recs), model
    assert _mid_prompt_sharers(recs) >= 20
    # Between two turns of a session more prompt tokens arrive than the gpt-oss default pool holds (blocks of 16
    # tokens), for most turns: the GPU prefix cache alone cannot keep the sessions.
    last: dict[str, int] = {}
    between = []
    for i, r in enumerate(recs):
        if r.session is not None and r.turn:
            between.append(sum(x.input_length for x in recs[last[r.session] + 1:i] if x.session != r.session))
        if r.session is not None:
            last[r.session] = i
    assert between and sorted(between)[len(between) // 2] > MODEL_DEFAULTS["gpt-oss-20b"].num_gpu_blocks * 16


def test_decode_heavy_returns_behind_long_decoders() -> None:
    recs = BUILTIN["decode-heavy"](0).records
    by = lambda phase: [r for r in recs if r.get("phase") == phase]  # noqa: E731
    decoders, returns, short = by("decoders"), by("return"), by("short-background")
    assert len(decoders) == 6 and all(1000 <= r.output_length <= 3500 for r in decoders)
    assert len(returns) == 12 and all(r.turn == 1 and r.input_length > 4096 for r in returns)
    for w in range(3):  # each wave's returns come 8-12 s after its decoders: mid-answer at Gemma's 15 ms a token
        d = [r.timestamp_ms for r in decoders[2 * w:2 * w + 2]]
        ret = [r.timestamp_ms for r in returns if r.session.startswith(f"w{w}-")]
        assert max(d) < min(ret) < max(d) + 13000
        assert sum(max(d) < r.timestamp_ms < max(ret) for r in short) >= 5  # short requests keep arriving
    assert len(by("siblings")) == 24


def test_mooncake_synthetic_is_carried() -> None:
    w = resolve_trace("mooncake-synthetic", 0)
    assert len(w.records) == 3993 and w.records[0].input_length == 40160


def test_time_model() -> None:
    tm = TimeModel(10.0, 50.0, 20.0, bandwidth_gbps=50.0)
    assert tm.step_seconds(1000, 2) == pytest.approx(0.010 + 0.050 + 0.00004)
    assert tm.step_seconds(0, 0) == pytest.approx(0.001)
    clock = SimClock(tm)
    clock.begin_batch(0, 1)
    done = [clock.schedule_transfer("load", 5 * 10**8), clock.schedule_transfer("load", 5 * 10**8)]
    assert done == pytest.approx([0.01, 0.02])  # 10 ms each at 50 GB/s, one after another
    assert clock.schedule_transfer("store", 10**9) == pytest.approx(0.02)  # the other direction is independent
    with pytest.raises(ValueError, match="bandwidth_gbps"):
        TimeModel(1.0, 1.0, 1.0, bandwidth_gbps=0)
    assert time_model_for("gemma-4-31b", overhead_ms=3.0).overhead_ms == 3.0


def test_parse_bytes() -> None:
    assert parse_bytes("40GiB") == 40 * 2**30 and parse_bytes("64g") == 64 * 10**9 and parse_bytes("100") == 100
    for bad in ("lots", "-1g", "0"):
        with pytest.raises(Exception, match="byte size"):
            parse_bytes(bad)


def test_plot_thinning_keeps_idle_gaps_and_the_last_point() -> None:
    from offload_bench.replay.plots import _thin

    t = [i * 0.01 for i in range(10_000)] + [500.0 + i * 0.01 for i in range(10_000)]
    series = {"t": t, "used": [0.5] * len(t)}
    thin = _thin(series, n=1000)
    assert len(thin["t"]) < 2500 and thin["t"][-1] == t[-1]
    assert t[9_999] in thin["t"] and 500.0 in thin["t"]  # both ends of the idle stretch
