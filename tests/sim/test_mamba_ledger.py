"""Mamba / gated-DeltaNet state next to attention (issue 26): the ledger on vLLM's real scheduler and Mamba manager.

vLLM keeps a Mamba group's state per block boundary only in `mamba_cache_mode: "align"`: block `i` holds the state
after `(i + 1) * b` tokens once a chunk has ended there, chunks end on block boundaries, and a request holds the
state block it resumes from plus one block per batch in flight (and a prefill checkpoint block per batch where the
layer exports one). The connector models such a group as a recycling group whose restore range is that one block
(`groups.GroupKind.MAMBA`). The checks are the fuzz's: every admitted load takes exactly the blocks predicted per
group, no request ever holds more blocks in a group than its ledger row allowed, nothing stalls, every run drains,
and a loaded Mamba block holds the state of its boundary (the simulated worker tags a state that ends inside a block
as no boundary's, and the driver states the block a resume reads rather than asking the connector).
"""

import dataclasses
import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload_bench.sim.fuzz import FuzzCase, random_case, run_case
from tests.sim.strategies import fuzz_case

ATTENTION = ["full", "mla", "sliding", "sliding_mla"]


@st.composite
def hybrid_groups(draw):
    bs = draw(st.sampled_from([16, 32, 64]))  # align mode: attention and Mamba share one block size
    groups = [("full", bs, 0)]
    for _ in range(draw(st.integers(0, 2))):
        kind = draw(st.sampled_from(ATTENTION))
        extent = draw(st.sampled_from([16, 64, 257, 512])) if kind.startswith("sliding") else 0
        groups.append((kind, bs, extent))
    for _ in range(draw(st.integers(1, 3))):
        groups.insert(draw(st.integers(0, len(groups))), ("mamba", bs, draw(st.sampled_from([0, 1]))))
    return groups


@st.composite
def hybrid_cases(draw):
    return fuzz_case(draw, draw(hybrid_groups()), speculative=False)


def _mamba_ceiling_one_short(real):
    """`groups.live_ceiling` with one block less for every Mamba group."""
    from offload_connector.groups import GroupKind

    def one_short(kind, *args, **kwargs):
        value = real(kind, *args, **kwargs)
        return value - 1 if kind is GroupKind.MAMBA else value

    return one_short


@settings(max_examples=int(os.environ.get("OFFLOAD_PROPERTY_EXAMPLES", "60")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(hybrid_cases())
def test_mamba_hybrid_ledger_properties(case):
    outcome = run_case(case)
    assert outcome.mismatches == []
    assert outcome.peak_violations == []
    assert outcome.stalls == 0 and outcome.idle_zero_steps == 0
    assert outcome.undrained == 0 and outcome.starved == []


def test_seeded_hybrid_cases_load_state_exactly() -> None:
    """The fuzz's own stream: a third of its cases are Mamba hybrids. Over 60 of them loads happen (so the checks
    above are not vacuous), under one, two and four batches in flight, with and without checkpoint blocks."""
    rng = random.Random(26)
    admissions = loaded = checked = 0
    seen_pp: set[int] = set()
    seen_ckpt: set[int] = set()
    cases = 0
    while cases < 60:
        case = random_case(rng)
        mamba = [extent for kind, _, extent in case.groups if kind == "mamba"]
        if not mamba:
            continue
        cases += 1
        out = run_case(case)
        assert out.ok, (case, out)
        admissions += out.admissions
        loaded += out.loaded_tokens
        checked += out.loads_peak_checked
        seen_pp.add(case.pipeline_parallel_size)
        seen_ckpt.update(mamba)
    assert seen_pp == {1, 2, 4} and seen_ckpt == {0, 1}
    assert admissions > 60 and loaded > 0 and checked == admissions


def test_a_ceiling_one_short_is_caught() -> None:
    """The peak check is what holds the Mamba ceiling honest: one block less than a batch's chunk-end block fails."""
    import offload_connector.groups as groups

    case = FuzzCase(groups=(("full", 32, 0), ("mamba", 32, 0)), max_num_batched_tokens=128, pool_factor=1.5,
                    sessions=((900, 4, 900, 300), (1500, 3, 1000, 200)), reset_prefix_cache=True, return_gaps=(0, 3),
                    latency_steps=2, seed=5)
    assert run_case(case).ok
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(groups, "live_ceiling", _mamba_ceiling_one_short(groups.live_ceiling))
        out = run_case(case)
    assert out.peak_violations, out


@st.composite
def hybrid_cases_with_drafts(draw):
    case = fuzz_case(draw, draw(hybrid_groups()), speculative=True)
    # vLLM 0.34 schedules nothing for a hybrid under a draft model with a 64-token budget (`fuzz.with_mamba`).
    return dataclasses.replace(case, max_num_batched_tokens=max(case.max_num_batched_tokens, 128))


@settings(max_examples=int(os.environ.get("OFFLOAD_PROPERTY_EXAMPLES", "60")) // 2, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(hybrid_cases_with_drafts())
def test_mamba_hybrid_ledger_properties_under_speculative_decoding(case):
    """EAGLE/MTP/n-gram drafts next to Mamba state: vLLM appends `num_speculative_blocks` state blocks to the group's
    table (a load's first allocation included) and relocates them as the state moves; the ledger counts them."""
    outcome = run_case(case)
    assert outcome.mismatches == []
    assert outcome.peak_violations == []
    assert outcome.stalls == 0 and outcome.idle_zero_steps == 0
    assert outcome.undrained == 0 and outcome.starved == []


def _spec_hybrid_cases(n: int) -> list[FuzzCase]:
    rng = random.Random(2605)
    cases: list[FuzzCase] = []
    while len(cases) < n:
        case = random_case(rng)
        if any(kind == "mamba" for kind, _, _ in case.groups) and case.num_spec_tokens:
            cases.append(case)
    return cases


def test_speculative_blocks_are_counted_in_every_load() -> None:
    """Without the speculative blocks in `load_blocks` the prediction of what a load takes is wrong."""
    import offload_connector.scheduler.ledger as ledger

    real = ledger.load_blocks

    def without_spec(group, hit, local):
        now, entries, live = real(group, hit, local)
        return now - group.spec_blocks, entries - group.spec_blocks, live - group.spec_blocks

    cases = _spec_hybrid_cases(6)
    admissions = 0
    for case in cases:
        out = run_case(case)
        assert out.ok, (case, out)
        admissions += out.admissions
    assert admissions > 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ledger, "load_blocks", without_spec)
        assert any(run_case(case).mismatches for case in cases)


def _answer_case(method: str, pipeline_parallel_size: int = 1) -> FuzzCase:
    """Two sessions whose answers cross a block boundary past their prompts (100 + 40 tokens: the state at 128; 64 +
    30: at 80) and return with the answer kept, after a prefix-cache reset: a return resumes from an answer's state."""
    return FuzzCase(groups=(("full", 16, 0), ("mamba", 16, 0)), max_num_batched_tokens=128, pool_factor=2.0,
                    sessions=((100, 40, 140, 20), (64, 30, 94, 10)), reset_prefix_cache=True, return_gaps=(0, 0),
                    latency_steps=1, seed=1, num_spec_tokens=3, spec_method=method,
                    pipeline_parallel_size=pipeline_parallel_size)


def _past_prompt_stores(mp: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """Watch the store planner: (request, prompt, tokens handed over) for every Mamba state past a prompt."""
    from offload_connector.groups import GroupKind
    from offload_connector.scheduler.stores import StorePlanner

    real_plan = StorePlanner.plan
    past_prompt: list[tuple[str, int, int]] = []

    def watched(self, state, computed, block_ids):
        real_plan(self, state, computed, block_ids)
        prompt = state.request.num_prompt_tokens
        for g in self.layout.groups:
            if g.kind is GroupKind.MAMBA:
                handed = max(state.window_next[g.index], state.spare_next.get(g.index, 0)) * g.block_size
                if handed > prompt:
                    past_prompt.append((state.request.request_id, prompt, handed))

    mp.setattr(StorePlanner, "plan", watched)
    return past_prompt


@pytest.mark.parametrize("method", ["ngram", "ngram_gpu", "eagle", "draft_model"])
def test_under_drafts_an_answers_state_is_stored_after_sampling_and_resumed_from(method: str) -> None:
    """In a decode step with drafts the forward leaves a boundary's state in a speculative block and vLLM copies the
    accepted one into the boundary's block after sampling; the store of such a point is issued from wait_for_save,
    after the copy. The returns load past their prompts' last states (96 and 64 tokens: 160 at most without answers'
    states; a synchronous engine reaches both answers', 128 + 80; under async scheduling a boundary's key exists a step
    later, and where the accepted drafts went past it vLLM has freed its block by then), and every loaded state is the right one (the simulated worker tags the boundary's block only at the copy)."""
    with pytest.MonkeyPatch.context() as mp:
        past_prompt = _past_prompt_stores(mp)
        out = run_case(_answer_case(method))
    assert out.ok, out
    assert out.loaded_tokens > 96 + 64
    assert past_prompt
    if method == "ngram":
        assert out.loaded_tokens == 128 + 80
        assert {"w0", "w1"} <= {rid for rid, _, _ in past_prompt}


def test_a_state_store_issued_before_sampling_reads_the_block_before_the_copy() -> None:
    """The same stores issued with the step's others (before sampling, as before wait_for_save carried them): under
    a synchronous engine the point a step reaches is copied in that step, after its stores read the block, and the
    return resumes from the state before the copy: the simulation catches it."""
    from offload_connector.transfer_jobs import TransferJob

    real = TransferJob.from_columns.__func__

    def before_sampling(cls, *args, **kwargs):
        kwargs.pop("after_sampling", None)
        return real(cls, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TransferJob, "from_columns", classmethod(before_sampling))
        out = run_case(_answer_case("ngram"))
    assert any("group 1" in m for m in out.mismatches), out


def test_under_drafts_and_pipeline_parallelism_no_state_past_the_prompt_is_stored() -> None:
    """Under PP each stage copies its own layers' states once the sampled tokens reach it, an order the connector
    does not read: there a state is stored only where a prefill forward wrote it. Without that rule one is."""
    from offload_connector.scheduler import state as state_mod

    cases = [c for c in _spec_hybrid_cases(8) if c.pipeline_parallel_size > 1]
    assert cases
    with pytest.MonkeyPatch.context() as mp:
        past_prompt = _past_prompt_stores(mp)
        for case in cases:
            assert run_case(case).ok
        assert past_prompt == []
        mp.setattr(state_mod.Layout, "state_behind_drafts", property(lambda self: False))
        for case in cases:
            run_case(case)
        assert past_prompt, "no decode step crossed a block boundary: the check above would be vacuous"


def test_a_ceiling_one_short_is_caught_under_drafts() -> None:
    """With speculative blocks in the ceiling, one block less is still caught by the peak check."""
    import offload_connector.groups as groups

    cases = _spec_hybrid_cases(8)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(groups, "live_ceiling", _mamba_ceiling_one_short(groups.live_ceiling))
        assert any(run_case(case).peak_violations for case in cases)


def test_a_request_vllm_only_sized_reserves_nothing() -> None:
    """vLLM's Mamba manager leaves an empty block list behind for a waiting request it sized and could not fit;
    counted as holding blocks, three such requests each reserved their whole prompt against the others and none was
    ever admitted (a stall found by the fuzz's hybrid cases with drafts)."""
    case = FuzzCase(groups=(("mamba", 64, 0), ("sliding", 64, 128), ("mamba", 64, 1), ("mamba", 64, 0),
                            ("full", 64, 0), ("sliding_mla", 64, 48)), max_num_batched_tokens=128,
                    pool_factor=1.0809199575021355, sessions=((2312, 1, 1912, 240), (2342, 3, 1423, 813),
                                                              (791, 4, 690, 1083), (77, 4, 27, 949),
                                                              (945, 2, 269, 289)),
                    reset_prefix_cache=False, return_gaps=(0, 1, 0, 0, 0), latency_steps=4, seed=680423852,
                    num_spec_tokens=4, spec_method="ngram_gpu", pipeline_parallel_size=1)
    out = run_case(case)
    assert out.ok and out.stalls == 0 and out.admissions >= 3, out


# Drawn by the fuzz's own stream (seed 26) once the simulation put a prefill checkpoint's state where vLLM's kernels
# write it (`driver._write_checkpoint_tag`): a Mamba group with checkpoint blocks next to sliding windows, full
# attention and MLA in 64-token blocks, one EAGLE draft, PP 2.
EAGLE_CHECKPOINT_CASE = FuzzCase(
    groups=(("sliding", 64, 512), ("sliding", 64, 257), ("full", 64, 0), ("mamba", 64, 1), ("mla", 64, 0)),
    max_num_batched_tokens=256, pool_factor=1.0752953083591805,
    sessions=((745, 6, 738, 365), (336, 1, 186, 100), (1159, 6, 26, 85), (818, 3, 657, 1072)),
    reset_prefix_cache=True, return_gaps=(0, 0, 0, 3), latency_steps=2, seed=1038142058, num_spec_tokens=1,
    spec_method="eagle", pipeline_parallel_size=2, resends=(False, False, False, False))


def test_a_prefill_checkpoint_block_is_never_stored_as_another_boundarys_state() -> None:
    """A chunk with an internal checkpoint writes the state after vLLM's checkpoint position into the block of
    column `cdiv(end, b) - 2`. Under EAGLE's block drop (vLLM 0.32 and 0.33) the position is one hash block before
    that column's end: here block 10 (boundary 704) holds the state after 640 tokens. Stored under block 10's key,
    a later request resumed from it; the connector now notes such blocks and stores them only under their own
    position's key (640's here). On 0.34 (lookahead hashes, no block drop) every checkpoint of this case is its
    column's own boundary."""
    from offload_connector.compat import vllm_release
    from offload_connector.scheduler.stores import StorePlanner

    real = StorePlanner._note_checkpoints
    noted: list[int] = []

    def spy(self, state) -> dict:
        cols = real(self, state)
        noted.append(len(state.foreign_states))
        return cols

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(StorePlanner, "_note_checkpoints", spy)
        out = run_case(EAGLE_CHECKPOINT_CASE)
    assert out.ok, out
    assert out.loaded_tokens > 0
    foreign = max(noted, default=0)
    if vllm_release() in ("0.32", "0.33"):
        assert foreign > 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(StorePlanner, "_note_checkpoints", lambda self, state: {})
        unfixed = run_case(EAGLE_CHECKPOINT_CASE)
    checkpoint_loads = [m for m in unfixed.mismatches if m.startswith("content:")]
    assert bool(checkpoint_loads) == (foreign > 0), unfixed.mismatches
