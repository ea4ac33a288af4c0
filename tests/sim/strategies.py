"""Hypothesis strategies shared by the property tests over `offload_bench.sim.fuzz` cases."""

from __future__ import annotations

from typing import Any, Sequence

from hypothesis import strategies as st

from offload_bench.sim.fuzz import PP_SIZES, SPEC_TOKENS, FuzzCase, spec_methods_for


def fuzz_case(draw: Any, groups: Sequence[tuple[str, int, int]], speculative: bool = True) -> FuzzCase:
    """A case over `groups`: returning sessions, pool, arrivals, transfer latency, batches in flight and (with
    `speculative`) drafts per step and how they are proposed."""
    sessions = []
    for _ in range(draw(st.integers(1, 5))):
        first = draw(st.integers(40, 2500))
        sessions.append((first, draw(st.integers(1, 6)), draw(st.integers(0, first + 6)), draw(st.integers(1, 1000))))
    kw: dict[str, Any] = dict(
        max_num_batched_tokens=draw(st.sampled_from([64, 128, 256, 512])),
        pool_factor=draw(st.floats(1.05, 3.0)), sessions=tuple(sessions), reset_prefix_cache=draw(st.booleans()),
        return_gaps=tuple(draw(st.sampled_from([0, 0, 1, 3, 10])) for _ in sessions),
        latency_steps=draw(st.integers(1, 4)), seed=draw(st.integers(0, 1 << 30)))
    if speculative:
        kw.update(num_spec_tokens=draw(st.sampled_from(SPEC_TOKENS)),
                  spec_method=draw(st.sampled_from(spec_methods_for(groups))))
    kw["resends"] = tuple(draw(st.sampled_from([False, False, False, True])) for _ in sessions)
    return FuzzCase(groups=tuple(groups), pipeline_parallel_size=draw(st.sampled_from(PP_SIZES)), **kw)
