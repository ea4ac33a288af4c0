"""Speculative decoding on vLLM's real scheduler: drafts, rollback, padded resumes after a load, and hits too big for
the pool once the spec and lookahead slots are counted.

The methods and the engine each runs on (a V1-runner deployment): CPU n-gram on a synchronous engine (drafts fed with
`update_draft_token_ids` after each step), GPU n-gram and a draft model under async scheduling (`AsyncScheduler`,
placeholder drafts), EAGLE likewise; the draft model and EAGLE also reserve `num_speculative_tokens` lookahead slots.
"""

import pytest

from offload_bench.sim.custom import SPEC_METHODS, build_custom
from offload_bench.sim.driver import SchedulerDriver
from offload_bench.sim.requests import hash_lookahead, make_request, tokens
from offload_bench.sim.scenarios import connector_config
from offload_bench.sim.tagcopy import TagCopier

METHODS = sorted(SPEC_METHODS)
LOOKAHEAD = {"ngram": False, "ngram_gpu": False, "draft_model": True, "eagle": True}


def _driver(groups, *, num_blocks, k, method="ngram", batch=64, seed=0):
    sched, hash_bs = build_custom(groups, num_blocks=num_blocks, max_num_batched_tokens=batch, max_model_len=2048,
                                  kv_transfer_config=connector_config("exact", 1 << 40),
                                  num_speculative_tokens=k, spec_method=method)
    drv = SchedulerDriver(sched, TagCopier(1), spec_seed=seed)
    outputs = []
    schedule = sched.schedule

    def recording_schedule(*args, **kwargs):
        out = schedule(*args, **kwargs)
        outputs.append(out)
        return out

    sched.schedule = recording_schedule
    return drv, hash_bs, outputs


def _drain(drv):
    res = drv.run(max_steps=5000, stall_steps=20)
    assert not res.stalled
    assert res.zero_token_steps_idle == 0
    assert drv.idle_invariant()


def _check_exact(adm):
    assert adm.free_after is not None, adm
    assert adm.free_before - adm.free_after == sum(adm.plan.now), adm
    assert adm.entries_after == adm.plan.entries, adm
    assert adm.live_after == adm.plan.live, adm


def _warm_then_return(drv, hash_bs, warm_prompt, returning_prompt, max_tokens=1):
    la = hash_lookahead(drv.sched)  # vLLM 0.34 with EAGLE: 1 (the connector supports lookahead block hashes)
    drv.add([make_request("w", warm_prompt, 1, hash_bs, hash_lookahead_tokens=la)])
    _drain(drv)
    drv.sched.reset_prefix_cache()  # only the CPU tier holds the prefix now
    ret = make_request("r", returning_prompt, max_tokens, hash_bs, hash_lookahead_tokens=la)
    drv.add([ret])
    _drain(drv)
    assert "r" in drv.finished
    return ret


@pytest.mark.parametrize("method", METHODS)
def test_spec_config_reaches_scheduler_and_ledger(method):
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    drv, _, _ = _driver([("full", 16, 0), ("sliding", 16, 64)], num_blocks=200, k=2, method=method)
    sched, side = drv.sched, drv.side
    lookahead = 2 if LOOKAHEAD[method] else 0
    assert sched.num_spec_tokens == 2 and sched.num_lookahead_tokens == lookahead
    assert isinstance(sched, AsyncScheduler) == SPEC_METHODS[method]
    assert sched.vllm_config.scheduler_config.async_scheduling == SPEC_METHODS[method]
    assert drv.feeds_drafts == (not SPEC_METHODS[method])
    assert drv.batch_depth == (2 if SPEC_METHODS[method] else 1)
    # The ledger reads the same numbers: its target is the prompt, one decode token, the drafts and the lookahead.
    assert side.num_spec_tokens == 2 and side.num_lookahead_tokens == lookahead
    req = make_request("x", tokens(1, 100), 4, 16)
    assert side.layout.target_tokens(req) == 100 + 1 + 2 + lookahead


@pytest.mark.parametrize("method", METHODS)
def test_drafts_are_scheduled_accepted_and_rolled_back(method):
    k, max_tokens = 2, 24
    drv, hash_bs, outputs = _driver([("full", 16, 0), ("sliding", 16, 32)], num_blocks=120, k=k, method=method,
                                    seed=3)
    req = make_request("d", tokens(5, 100), max_tokens, hash_bs, hash_lookahead_tokens=hash_lookahead(drv.sched))
    drv.add([req])
    _drain(drv)
    assert "d" in drv.finished
    # Exactly max_tokens outputs, all the simulated model's token, whatever was accepted.
    assert list(req.output_token_ids) == [7] * max_tokens
    spec_steps = [o for o in outputs if o.scheduled_spec_decode_tokens.get("d")]
    assert spec_steps, "no step scheduled drafts"
    assert all(o.num_scheduled_tokens["d"] == 1 + len(o.scheduled_spec_decode_tokens["d"]) for o in spec_steps)
    assert 0 < drv.drafts_accepted < drv.drafts_scheduled  # some drafts were rejected and rolled back
    # Accepted drafts saved decode steps.
    decode_steps = [o for o in outputs if "d" in o.num_scheduled_tokens and o.num_scheduled_tokens["d"] <= 1 + k
                    and "d" not in [n.req_id for n in o.scheduled_new_reqs]]
    assert len(decode_steps) < max_tokens


@pytest.mark.parametrize("method", METHODS)
def test_load_resumed_one_token_short_runs_a_padded_spec_step(method):
    """A load that leaves one prompt token: vLLM pads the request's first step to 1 + k tokens (+ lookahead slots).

    The prediction equals the allocation per group, and the blocks the padded step takes stay within the ledger's
    `remaining` (its target counts the decode token, the drafts and the lookahead).
    """
    k = 4
    groups = [("full", 16, 0), ("sliding", 16, 48)]
    drv, hash_bs, outputs = _driver(groups, num_blocks=80, k=k, method=method)
    warm = tokens(11, 256)
    # The return continues with the token the warm request sampled (the driver samples 7): with vLLM 0.34's
    # lookahead hashes under EAGLE the last block's key covers that token, and another token would miss it.
    ret = _warm_then_return(drv, hash_bs, warm, warm + [7], max_tokens=3)
    side = drv.side
    adm = [a for a in side.admissions if a.request_id == "r"]
    assert len(adm) == 1 and adm[0].plan.hit_tokens == 256 == ret.num_prompt_tokens - 1
    _check_exact(adm[0])
    assert side.counters.loaded_tokens == 256
    first = next(o for o in outputs if "r" in o.num_scheduled_tokens)
    assert first.num_scheduled_tokens["r"] == 1 + k
    assert list(first.scheduled_spec_decode_tokens["r"]) == [-1] * k
    # Blocks the first step after the load took, per group: within what the ledger still reserved.
    new_ids = {nr.req_id: nr.block_ids for nr in first.scheduled_new_reqs}
    if "r" in new_ids:
        taken = [len(ids) - e for ids, e in zip(new_ids["r"], adm[0].plan.entries)]
    else:
        cached = first.scheduled_cached_reqs
        i = list(cached.req_ids).index("r")
        taken = [len(ids) for ids in cached.new_block_ids[i]]
    assert all(t <= r for t, r in zip(taken, adm[0].plan.remaining)), (taken, adm[0].plan.remaining)
    assert list(ret.output_token_ids) == [7] * 3


def test_too_big_with_spec_slots_recomputes_and_completes():
    """A hit that fits an idle pool without spec decode but not with its draft and lookahead slots.

    Pool: 20 usable blocks of 16. Returning prompt 316 tokens, 304 of them in the CPU tier. Without spec decode the
    load needs cdiv(316 + 1, 16) = 20 blocks and is admitted exactly as predicted. With a draft model (k = 4, 4
    lookahead slots) the ledger needs cdiv(316 + 1 + 4 + 4, 16) = 21 > 20: TOO_BIG, so the request recomputes
    (prefill needs cdiv(316 + 4, 16) = 20) and completes.

    No shorter hit could be admitted instead: per group a load's total (now + remaining) is the capped target need
    minus the local prefix blocks other requests hold inside the window, whatever the hit length; so the connector
    goes straight to recompute (one decision, no per-length lookups).
    """
    groups = [("full", 16, 0)]
    warm = tokens(21, 304)
    returning = warm + tokens(22, 12)

    drv, hash_bs, _ = _driver(groups, num_blocks=21, k=0)
    _warm_then_return(drv, hash_bs, warm, returning)
    adm = [a for a in drv.side.admissions if a.request_id == "r"]
    assert len(adm) == 1 and adm[0].plan.hit_tokens == 304
    assert adm[0].plan.total == 20
    _check_exact(adm[0])
    assert drv.side.counters.too_big == 0

    drv, hash_bs, outputs = _driver(groups, num_blocks=21, k=4, method="draft_model")
    ret = _warm_then_return(drv, hash_bs, warm, returning)
    counters = drv.side.counters
    assert not [a for a in drv.side.admissions if a.request_id == "r"]
    assert counters.too_big == 1  # decided once; the request is not asked about again
    assert counters.loads_admitted == 0 and counters.loaded_tokens == 0
    assert drv.side.view().requests.get("r") is None or drv.side.view().requests["r"].no_load
    assert sum(o.num_scheduled_tokens.get("r", 0) for o in outputs) >= 316  # recomputed from scratch
    assert list(ret.output_token_ids) == [7]


def test_async_spec_final_block_is_stored_with_its_tokens():
    """Regression (fuzz, both vLLM versions): a request finishing under async scheduling with a batch still in flight.

    The finished request's last block is complete only counting the in-flight batch's first row (its last sampled
    token, at the position the worker corrects for rejected drafts); the connector stores it at `request_finished`
    and a later request loads it. The driver's tags must count that row, or the load check reads a stale block.
    """
    from offload_bench.sim.fuzz import FuzzCase, run_case

    case = FuzzCase(groups=(("full", 32, 0),), max_num_batched_tokens=512, pool_factor=1.5413051861545548,
                    sessions=((2536, 5, 2320, 432), (399, 5, 125, 69), (2012, 4, 2016, 494)),
                    reset_prefix_cache=True, return_gaps=(0, 0, 3), latency_steps=2, seed=714237722,
                    num_spec_tokens=1, spec_method="draft_model")
    out = run_case(case)
    assert out.ok, out
    assert out.admissions == 3 and out.drafts_scheduled > 0
