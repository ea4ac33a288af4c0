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

FULL = (("full", 16, 0),)
# A 64-token window next to full attention: checkpoints every 64 tokens (`windows.checkpoint_spacing`), so the prompt
# keeps a window at every 64 tokens and every window block is stored (32 + 32 entries).
WINDOWED = (("full", 16, 0), ("sliding", 16, 64))
SLOTS = {FULL: 40, WINDOWED: 72}
PROMPT = 512  # 32 blocks per group, stored in four 128-token chunks
OTHER = 256  # 16 blocks per group: 8 (full) or 24 (windowed) more than the tier has free after the prompt


def rig(groups, cpu_bytes: int) -> tuple[SchedulerDriver, int]:
    sched, hbs = build_custom(groups, num_blocks=400, max_num_batched_tokens=128, max_model_len=2048,
                              kv_transfer_config=connector_config("exact", cpu_bytes, spare_windows=False))
    return SchedulerDriver(sched, TagCopier(), batch_depth=1), hbs


@pytest.fixture(scope="module", params=[FULL, WINDOWED], ids=["full", "windowed"])
def layout(request) -> tuple:
    drv, _ = rig(request.param, 1 << 30)
    return request.param, (1 << 30) // drv.side.tier.capacity_slots + 1


def scene(layout: tuple) -> int:
    """The prompt stored and finished, an unrelated prompt that evicts part of it, then the prompt asked again with
    the GPU prefix cache reset: returns the tokens it loaded from the CPU tier."""
    groups, per_slot = layout
    drv, hbs = rig(groups, SLOTS[groups] * per_slot)
    assert drv.side.tier.capacity_slots == SLOTS[groups]
    prompt = tokens(1, PROMPT)
    drv.add([make_request("a", prompt, 1, hbs)])
    drain(drv)
    drv.add([make_request("b", tokens(2, OTHER), 1, hbs)])
    drain(drv)
    assert drv.side.tier.evictions == (8 if groups is FULL else 24)
    assert_ok(step_invariants(drv))
    assert drv.sched.reset_prefix_cache()
    before = drv.side.counters.loaded_tokens
    drv.add([make_request("a2", prompt + tokens(3, 64), 1, hbs)])
    drain(drv)
    return drv.side.counters.loaded_tokens - before


def test_a_partly_evicted_prompt_keeps_its_head(layout):
    # Full attention: 24 of 32 blocks stay, from the first one, and 384 tokens load. Windowed: the 24 evicted entries
    # are the points 512 (window block 31, full block 31), 496 (window and full blocks 28-30), 448 (24-27 of each)
    # and 384 (20-23 of each), the last point first: it resumes at 320.
    assert scene(layout) == (PROMPT - 8 * 16 if layout[0] is FULL else 320)


def test_ranked_in_store_order_its_head_goes_first(layout, monkeypatch):
    """The same scene without the ranking at the request's end: the first chunk is evicted and nothing loads, so the
    test above is not vacuous."""
    from offload_connector.scheduler.core import OffloadScheduler

    monkeypatch.setattr(OffloadScheduler, "_rank_for_eviction", lambda self, state: None)
    assert scene(layout) == 0
