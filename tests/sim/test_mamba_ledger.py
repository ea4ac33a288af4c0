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

import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload_bench.sim.fuzz import FuzzCase, random_case, run_case
from tests.sim.strategies import fuzz_case

ATTENTION = ["full", "mla", "sliding", "sliding_mla"]


@st.composite
def hybrid_cases(draw):
    bs = draw(st.sampled_from([16, 32, 64]))  # align mode: attention and Mamba share one block size
    groups = [("full", bs, 0)]
    for _ in range(draw(st.integers(0, 2))):
        kind = draw(st.sampled_from(ATTENTION))
        extent = draw(st.sampled_from([16, 64, 257, 512])) if kind.startswith("sliding") else 0
        groups.append((kind, bs, extent))
    for _ in range(draw(st.integers(1, 3))):
        groups.insert(draw(st.integers(0, len(groups))), ("mamba", bs, draw(st.sampled_from([0, 1]))))
    return fuzz_case(draw, groups, speculative=False)


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
    real = groups.live_ceiling

    def one_short(kind, *args, **kwargs):
        value = real(kind, *args, **kwargs)
        return value - 1 if kind is groups.GroupKind.MAMBA else value

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(groups, "live_ceiling", one_short)
        out = run_case(case)
    assert out.peak_violations, out
