"""Sliding-window groups are stored only where a request can resume, not for every block."""

from collections import Counter

import pytest

from offload_bench.sim.driver import SchedulerDriver
from offload_bench.sim.layouts import build_scheduler, build_sim_model, build_vllm_config
from offload_bench.sim.requests import make_request, tokens
from offload_bench.sim.scenarios import connector_config
from offload_bench.sim.tagcopy import TagCopier


@pytest.mark.parametrize("spacing, share", [(0, 1 / 5), (8192, 0.25), (4096, 0.35)])
def test_gemma4_16k_conversation_host_bytes(spacing, share):
    """Without checkpoints a 16k conversation takes at most a fifth of the bytes of storing every block; with the
    default 8,192-token checkpoints at most a quarter: every full-attention block (80 KiB of 880 KiB per token) plus
    the 1,024-token windows at 8,192 and at the prompt's end, and the answer's blocks (4,096: 0.35)."""
    vc = build_vllm_config("gemma-4-31b", max_model_len=32768, max_num_batched_tokens=1024, num_gpu_blocks=2188,
                           kv_transfer_config=connector_config("exact", 64 * 2**30,
                                                               window_checkpoint_tokens=spacing,
                                                               spare_windows=False))
    sim = build_sim_model("gemma-4-31b", vllm_config=vc, num_blocks=2188)
    drv = SchedulerDriver(build_scheduler(sim, vc), TagCopier(1))
    # A 16,384-token conversation: a 16,000-token prompt and 384 generated tokens.
    drv.add([make_request("conv", tokens(5, 16_000), 384, sim.hash_block_size)])
    result = drv.run()
    assert not result.stalled and drv.idle_invariant()
    side = drv.side
    stats = side.tier.stats()
    hashed = 16_383 // 16 * 16  # tokens whose blocks carry hashes (the last sampled token is never computed)
    every_block = sum((hashed // g.block_size) * g.block_bytes for g in side.groups)
    assert stats.used_bytes <= every_block * share, (stats.used_bytes, every_block)
    # And the full-attention group is stored whole, so the conversation can come back at its end.
    assert side.admission.hit(_replay(sim), 16_383) > 16_000


def _replay(sim):
    # The returning turn: the whole conversation plus one new token.
    return make_request("again", tokens(5, 16_000) + [7] * 384 + [123], 1, sim.hash_block_size)



def test_decode_never_re_stores_window_blocks_the_tier_evicted():
    """Each sliding-window block is handed to the tier at most once per request, even when the tier evicts it.

    Re-storing the whole window at every decode boundary after an eviction made a saturated 64 GiB tier copy about
    2,500 blocks per step at 256 running requests (offload-connector sched-overhead)."""
    slot_bytes = 2_621_440  # one Gemma-4-31B block id across all layers of its largest group
    vc = build_vllm_config("gemma-4-31b", max_model_len=32768, max_num_batched_tokens=1024, num_gpu_blocks=2188,
                           kv_transfer_config=connector_config("exact", 400 * slot_bytes, spare_windows=False))
    sim = build_sim_model("gemma-4-31b", vllm_config=vc, num_blocks=2188)
    drv = SchedulerDriver(build_scheduler(sim, vc), TagCopier(1))
    side = drv.side
    reservations: Counter = Counter()
    begin = side.tier.begin_store

    def counting(keys, **kwargs):
        out = begin(keys, **kwargs)
        reservations.update(key for key, _slot in out)
        return out

    side.tier.begin_store = counting
    drv.add([make_request("long-decode", tokens(9, 3_000), 2_000, sim.hash_block_size)])
    result = drv.run()
    assert not result.stalled and drv.idle_invariant()
    assert side.tier.evictions > 0  # the tier was under pressure, so evicted window blocks existed
    assert max(reservations.values()) == 1
    prompt_boundary = 3_000 - 3_000 % side.alignment
    last_boundary = (3_000 + 2_000 - 1) // side.alignment * side.alignment
    per_group = Counter(key[0] for key in reservations)
    for g in side.groups:
        if g.recycling:
            # The prompt's window, then only the blocks each decode boundary adds.
            first_window = len(g.restore_range(prompt_boundary))
            added = (last_boundary - prompt_boundary) // g.block_size
            assert per_group[g.index] <= first_window + added, (g.index, per_group)


@pytest.mark.parametrize("slots", [400, 4000])
def test_spare_windows_leave_the_regular_entries_as_they_were(slots):
    """Spare windows take only room no regular entry uses: under pressure (400 slots, two long Gemma 4 31B requests)
    and with room (4,000), the tier ends with exactly the regular entries it holds without them; with room it holds
    every other window too, and under pressure the spare ones were the ones evicted."""
    def run(spare: bool):
        vc = build_vllm_config("gemma-4-31b", max_model_len=32768, max_num_batched_tokens=1024, num_gpu_blocks=2188,
                               kv_transfer_config=connector_config("exact", slots * 2_621_440, spare_windows=spare))
        sim = build_sim_model("gemma-4-31b", vllm_config=vc, num_blocks=2188)
        drv = SchedulerDriver(build_scheduler(sim, vc), TagCopier(1))
        drv.add([make_request("a", tokens(9, 3_000), 200, sim.hash_block_size),
                 make_request("b", tokens(10, 6_000), 50, sim.hash_block_size)])
        assert not drv.run().stalled and drv.idle_invariant()
        tier = drv.side.tier
        return {k for k in tier.keys() if not tier.is_spare(k)}, tier.stats()

    without, _ = run(False)
    regular, stats = run(True)
    assert regular == without
    if slots == 4000:
        assert stats.spare_entries > 1000 and stats.evictions == 0
    else:
        assert stats.spare_evictions > 0 and stats.used_slots == slots
