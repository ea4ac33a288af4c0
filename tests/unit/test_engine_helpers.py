"""The real-engine tests' output comparison (`tests/engine_helpers.assert_same_output`): greedy tokens and top-k
log-probabilities, bit for bit."""

from __future__ import annotations

import json
import math

import pytest

from tests.engine_helpers import assert_same_output

REF = {"token_ids": [5, 9, 7], "logprobs": [[[5, -0.25], [3, -1.5]], [[9, -0.5], [2, -0.75]], [[7, -1.0], [1, -2.0]]]}


def _copy(out: dict) -> dict:
    return {"token_ids": list(out["token_ids"]), "logprobs": [[list(e) for e in s] for s in out["logprobs"]]}


def test_identical_outputs_pass() -> None:
    assert_same_output(_copy(REF), REF)
    assert_same_output({"token_ids": [1, 2]}, {"token_ids": [1, 2]})  # neither engine returned log-probabilities


def test_a_different_token_names_its_index() -> None:
    got = _copy(REF)
    got["token_ids"][1] = 2
    with pytest.raises(AssertionError, match="reload: tokens differ from index 1"):
        assert_same_output(got, REF, "reload")
    with pytest.raises(AssertionError, match="tokens differ from index 2"):  # one output stopped early
        assert_same_output({**_copy(REF), "token_ids": [5, 9]}, REF)


def test_the_same_tokens_with_a_log_probability_one_ulp_apart_fail() -> None:
    got = _copy(REF)
    got["logprobs"][2][1][1] = math.nextafter(-2.0, 0.0)  # the runner-up of the last token, in its last bit
    with pytest.raises(AssertionError, match="same tokens, log-probabilities differ from token 2"):
        assert_same_output(got, REF)


def test_a_missing_log_probability_entry_fails() -> None:
    got = _copy(REF)
    del got["logprobs"][2]
    with pytest.raises(AssertionError, match="differ from token 2: None against"):
        assert_same_output(got, REF)


def test_log_probabilities_in_one_output_only_fail() -> None:
    with pytest.raises(AssertionError, match="one output only"):
        assert_same_output({"token_ids": REF["token_ids"]}, REF)


def test_a_difference_names_whether_the_engines_model_digests_agree() -> None:
    """Each output carries its engine's model digest (weights, buffers and packed linear layers, before the first
    request): a divergence between engines whose digests differ is theirs, not the connector's, and says so."""
    got = {**_copy(REF), "engine_model": "aa"}
    got["token_ids"][1] = 2
    with pytest.raises(AssertionError, match="model digests differ, aa against bb"):
        assert_same_output(got, {**REF, "engine_model": "bb"})
    with pytest.raises(AssertionError, match="model digests are equal: aa"):
        assert_same_output(got, {**REF, "engine_model": "aa"})
    got = {**_copy(REF), "engine_model": "aa"}
    got["logprobs"][0][0][1] = -0.3
    with pytest.raises(AssertionError, match="log-probabilities differ from token 0.*model digests differ"):
        assert_same_output(got, {**REF, "engine_model": "bb"})
    assert_same_output({**_copy(REF), "engine_model": "aa"}, {**REF, "engine_model": "bb"})  # equal outputs pass


def _run(tokens: list[int], digest: str = "d") -> dict:
    return {"weights": [digest], "actions": [{"op": "generate", "outputs": {"r": {"token_ids": tokens}}}]}


@pytest.mark.parametrize(("runs", "chosen", "count"), [
    ([[1, 2], [1, 2]], 0, 2),            # two agree: no third engine
    ([[9, 9], [1, 2], [1, 2]], 1, 3),    # the first engine was odd: the other two decide
    ([[1, 2], [9, 9], [1, 2]], 0, 3),    # the second was odd
])
def test_a_reference_is_a_run_another_engine_reproduced(monkeypatch: pytest.MonkeyPatch, runs: list, chosen: int,
                                                        count: int) -> None:
    from tests import engine_helpers
    made = [_run(t, f"d{i}") for i, t in enumerate(runs)]
    calls = iter(made)
    monkeypatch.setattr(engine_helpers, "run_engine", lambda *a, **k: next(calls))
    got = engine_helpers.reference_run({"actions": []})
    assert got is made[chosen] and got["reference"]["runs"] == count and got["reference"]["agreeing"] >= 2
    assert next(calls, None) is None


def test_a_reference_no_two_engines_agree_on_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests import engine_helpers
    calls = iter([_run([1]), _run([2]), _run([3])])
    monkeypatch.setattr(engine_helpers, "run_engine", lambda *a, **k: next(calls))
    with pytest.raises(engine_helpers.EngineRunError, match="no two of 3 reference engines"):
        engine_helpers.reference_run({"actions": []})


def _controlled(control: list[int], tokens: list[int] | None = None) -> dict:
    """An engine run's result with the control request's output `control` (and request "r" giving `tokens`)."""
    return {"weights": ["d"], "control": {"outputs": {"control": {"token_ids": control}}},
            "actions": [{"op": "generate", "outputs": {"r": {"token_ids": tokens or [1]}}}]}


def _fake_engines(monkeypatch: pytest.MonkeyPatch, results: list[dict]) -> list[dict]:
    from tests import engine_helpers
    scripts: list[dict] = []
    calls = iter(results)

    def run(script: dict, *a, **k) -> dict:
        scripts.append(script)
        return next(calls)
    monkeypatch.setattr(engine_helpers, "run_engine", run)
    monkeypatch.setenv("OC_ENGINE_LOG_DIR", "")
    return scripts


def test_a_checked_engine_runs_the_control_request_first_and_is_not_rerun_when_it_matches(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from tests import engine_helpers
    first = _controlled([4, 4])
    scripts = _fake_engines(monkeypatch, [first])
    got = engine_helpers.checked_run({"actions": [{"op": "drain"}]}, _controlled([4, 4]))
    assert got is first and "odd_before" not in got
    assert len(scripts) == 1 and scripts[0]["actions"][0]["control"] is True
    assert scripts[0]["actions"][0]["requests"][0]["id"] == "control" and scripts[0]["actions"][1] == {"op": "drain"}


def test_an_engine_odd_before_any_load_is_rerun_once_and_noted(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from tests import engine_helpers
    odd, good = _controlled([4, 5]), _controlled([4, 4])
    _fake_engines(monkeypatch, [odd, good])
    monkeypatch.setenv("OC_ENGINE_LOG_DIR", str(tmp_path))
    got = engine_helpers.checked_run({"actions": []}, _controlled([4, 4]))
    assert got is good and "tokens differ from index 1" in got["odd_before"]
    events = [json.loads(line) for line in (tmp_path / "odd-engines.jsonl").read_text().splitlines()]
    assert [(e["kind"], e["rerun"]) for e in events] == [("connector", True)]


def test_two_odd_engines_in_a_row_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests import engine_helpers
    _fake_engines(monkeypatch, [_controlled([4, 5]), _controlled([5, 5])])
    with pytest.raises(engine_helpers.OddEngineError, match="two engines in a row"):
        engine_helpers.checked_run({"actions": []}, _controlled([4, 4]))


def test_a_difference_after_the_control_is_never_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control matched: whatever differs later is the test's to judge (the run is returned as it is)."""
    from tests import engine_helpers
    run = _controlled([4, 4], tokens=[9, 9])
    scripts = _fake_engines(monkeypatch, [run, _controlled([4, 4])])
    assert engine_helpers.checked_run({"actions": []}, _controlled([4, 4], tokens=[1, 1])) is run
    assert len(scripts) == 1


def test_a_scenario_runs_again_from_fresh_state_only_for_an_odd_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests import engine_helpers
    _fake_engines(monkeypatch, [_controlled([4, 5]), _controlled([4, 4]), _controlled([4, 4])])
    attempts: list[int] = []

    def engines(attempt: int) -> tuple[dict, dict]:
        attempts.append(attempt)
        return (engine_helpers.checked_run({"actions": []}, _controlled([4, 4]), rerun=False),
                engine_helpers.checked_run({"actions": []}, _controlled([4, 4]), rerun=False))
    engine_helpers.scenario(engines)
    assert attempts == [0, 1]
    def fails(attempt: int) -> None:
        attempts.append(attempt)
        raise AssertionError("boom")
    with pytest.raises(AssertionError, match="boom"):  # any other failure is not retried
        engine_helpers.scenario(fails)
    assert attempts == [0, 1, 0]


def test_a_run_without_a_control_output_is_an_error_not_an_odd_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests import engine_helpers
    _fake_engines(monkeypatch, [_controlled([4, 4])])
    with pytest.raises(engine_helpers.EngineRunError, match="no control output"):
        engine_helpers.checked_run({"actions": []}, {"actions": []})


def test_a_compared_run_is_a_reference_pair_without_a_reference_and_a_checked_engine_with_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`compared_run`: the tests that build both sides alike (TP/PP, hybrid TP2) get a reference pair when they
    pass no reference, and a connector engine whose control is checked when they pass one."""
    from tests import engine_helpers
    a, b = _controlled([4, 4]), _controlled([4, 4])
    scripts = _fake_engines(monkeypatch, [a, b])
    ref = engine_helpers.compared_run({"actions": []}, None)
    assert len(scripts) == 2 and ref in (a, b)  # two engines that agree
    odd, good = _controlled([4, 5]), _controlled([4, 4])
    scripts = _fake_engines(monkeypatch, [odd, good])
    assert engine_helpers.compared_run({"actions": []}, ref) is good  # checked: the odd engine was run again
    assert len(scripts) == 2


def test_the_control_request_runs_again_after_the_last_action_and_a_failed_comparison_names_it() -> None:
    """The end control judges nothing; when a comparison fails it says whether both engines still computed the
    control request alike after their last action."""
    from tests import engine_helpers
    script = engine_helpers.with_control({"actions": [{"op": "drain"}]})
    first, end = script["actions"][0], script["actions"][-1]
    assert first["control"] is True and end["control"] == "end" and script["actions"][1] == {"op": "drain"}
    assert end["requests"][0]["prompt_token_ids"] == first["requests"][0]["prompt_token_ids"]

    def run(end_tokens: list[int], tokens: list[int]) -> dict:
        res = _controlled([4, 4], tokens)
        res["control_end"] = {"outputs": {engine_helpers.END_CONTROL_ID: {"token_ids": end_tokens}}}
        return engine_helpers.mark_end_control(res)
    ref, same_end, odd_end = run([4, 4], [1, 2]), run([4, 4], [1, 3]), run([4, 5], [1, 3])
    assert engine_helpers.output_of(ref, "r")["engine_end_control"] == \
        engine_helpers.output_of(same_end, "r")["engine_end_control"]
    with pytest.raises(AssertionError, match="tokens differ from index 1.*end controls are equal"):
        assert_same_output(engine_helpers.output_of(same_end, "r"), engine_helpers.output_of(ref, "r"))
    with pytest.raises(AssertionError, match="end controls differ"):
        assert_same_output(engine_helpers.output_of(odd_end, "r"), engine_helpers.output_of(ref, "r"))
    without = engine_helpers.mark_end_control(_controlled([4, 4]))  # no end control (an engine ended early)
    assert "engine_end_control" not in engine_helpers.output_of(without, "r")
