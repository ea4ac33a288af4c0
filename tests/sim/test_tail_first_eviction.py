"""A prompt the tier must partly evict loses its tail, not its head.

Stores hand a prompt to the tier chunk by chunk in prefix order, so in the order entries became evictable the head of
a prompt is its oldest part. Left that way, the first eviction takes the head and the blocks that stay cannot be
loaded (a hit needs the prefix from its first token). vLLM's LRU ranks a finished request's blocks tail first; the
tier ranks them by resume point, last point first (`scheduler/ranking.py`), once the request's last store has landed.
"""

from __future__ import annotations

import pytest

from offload_bench.sim.custom import build_custom
from offload_bench.sim.driver import SchedulerDriver
from offload_bench.sim.faults import assert_ok, drain, step_invariants
from offload_bench.sim.requests import make_request, tokens
from offload_bench.sim.scenarios import connector_config
from offload_bench.sim.tagcopy import TagCopier

GROUPS = (("full", 16, 0),)
SLOTS = 40
PROMPT = 512  # 32 blocks, stored in four 128-token chunks
OTHER = 256  # 16 blocks: 8 more than the tier has free after the prompt


def rig(cpu_bytes: int) -> tuple[SchedulerDriver, int]:
    sched, hbs = build_custom(GROUPS, num_blocks=400, max_num_batched_tokens=128, max_model_len=2048,
                              kv_transfer_config=connector_config("exact", cpu_bytes))
    return SchedulerDriver(sched, TagCopier(), batch_depth=1), hbs


@pytest.fixture(scope="module")
def per_slot() -> int:
    drv, _ = rig(1 << 30)
    return (1 << 30) // drv.side.tier.capacity_slots + 1


def scene(per_slot: int) -> int:
    """The prompt stored and finished, an unrelated prompt that evicts 8 of its 32 blocks, then the prompt asked again
    with the GPU prefix cache reset: returns the tokens it loaded from the CPU tier."""
    drv, hbs = rig(SLOTS * per_slot)
    assert drv.side.tier.capacity_slots == SLOTS
    prompt = tokens(1, PROMPT)
    drv.add([make_request("a", prompt, 1, hbs)])
    drain(drv)
    drv.add([make_request("b", tokens(2, OTHER), 1, hbs)])
    drain(drv)
    assert drv.side.tier.evictions >= 8
    assert_ok(step_invariants(drv))
    assert drv.sched.reset_prefix_cache()
    before = drv.side.counters.loaded_tokens
    drv.add([make_request("a2", prompt + tokens(3, 64), 1, hbs)])
    drain(drv)
    return drv.side.counters.loaded_tokens - before


def test_a_partly_evicted_prompt_keeps_its_head(per_slot):
    # 24 of 32 blocks stay, from the first one: 384 tokens load.
    assert scene(per_slot) == PROMPT - 8 * 16


def test_ranked_in_store_order_its_head_goes_first(per_slot, monkeypatch):
    """The same scene without the ranking at the request's end: the first chunk is evicted and nothing loads, so the
    test above is not vacuous."""
    from offload_connector.scheduler.core import OffloadScheduler

    monkeypatch.setattr(OffloadScheduler, "_rank_for_eviction", lambda self, state: None)
    assert scene(per_slot) == 0
