"""Random lifecycles on vLLM's real scheduler: arrivals sharing prefixes, aborts at random steps (during lookups,
deferrals, loads, prefill, stores and decode), forced and pool-pressure preemptions, failing store and load jobs, and a
CPU tier of a few blocks. After every step each tier pin is explained by an in-flight job and every readable tier
entry holds its own tokens; loaded blocks are checked by tag; after the run the GPU pool, the tier and the connector's
bookkeeping are back to empty (`sim/faults.py`). `OFFLOAD_LIFECYCLE_EXAMPLES` raises the example count.
"""

import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import random

from offload_bench.sim.faults import LAYOUTS, LifecycleCase, LifecycleOutcome, random_case, run_lifecycle


@st.composite
def cases(draw):
    n = draw(st.integers(2, 7))
    requests = tuple((draw(st.integers(0, 2)), draw(st.integers(0, 500)), draw(st.integers(1, 150)),
                      draw(st.integers(1, 200))) for _ in range(n))
    return LifecycleCase(
        layout=draw(st.sampled_from(sorted(LAYOUTS))),
        pool_factor=draw(st.floats(1.05, 3.0)),
        prefix_caching=draw(st.booleans()),
        cpu_slots=draw(st.sampled_from([3, 6, 12, 24, 60, 400, 400])),
        max_num_batched_tokens=draw(st.sampled_from([32, 64, 128])),
        batch_depth=draw(st.sampled_from([1, 2])),
        load_latency=draw(st.integers(1, 4)),
        store_latency=draw(st.sampled_from([1, 2, 3, 5, 12])),
        requests=requests,
        arrival_gaps=tuple(draw(st.sampled_from([0, 0, 1, 3, 8, 20])) for _ in requests),
        p_abort=draw(st.sampled_from([0.0, 0.02, 0.08])),
        p_preempt=draw(st.sampled_from([0.0, 0.02, 0.08])),
        p_reset=draw(st.sampled_from([0.0, 0.05, 0.3])),
        p_store_fail=draw(st.sampled_from([0.0, 0.0, 0.1, 0.4])),
        p_load_fail=draw(st.sampled_from([0.0, 0.0, 0.2])),
        seed=draw(st.integers(0, 1 << 20)),
    )


@settings(max_examples=int(os.environ.get("OFFLOAD_LIFECYCLE_EXAMPLES", "150")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_lifecycle_invariants_under_random_aborts_preemption_and_failures(case):
    run_lifecycle(case)


def test_lifecycle_seeded_random_cases_cover_every_stage():
    """A fixed batch of random cases (hypothesis favours small ones): the same invariants, and the batch must reach
    the stages it is meant to: aborts of loading requests, vLLM's own preemptions, failed jobs, a full tier, fences."""
    rng = random.Random(2026)
    total = LifecycleOutcome()
    for _ in range(int(os.environ.get("OFFLOAD_LIFECYCLE_CASES", "120"))):
        out = run_lifecycle(random_case(rng))
        for name, value in vars(out).items():
            setattr(total, name, getattr(total, name) + value)
    assert total.orphaned_loads > 0 and total.aborted > 0 and total.preempted > 0 and total.preempted_by_vllm > 0
    assert total.loads > 0 and total.stores_failed > 0 and total.loads_failed > 0
    assert total.evictions > 0 and total.store_rejections > 0 and total.fenced > 0
