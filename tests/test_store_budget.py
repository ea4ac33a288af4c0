"""Sliding-window groups are stored only where a request can resume, not for every block."""

from offload_connector.sim.driver import SchedulerDriver, TagCopyEngine
from offload_connector.sim.layouts import build_scheduler, build_sim_model, build_vllm_config
from offload_connector.sim.requests import make_request, tokens
from offload_connector.sim.scenarios import connector_config


def test_gemma4_16k_conversation_takes_at_most_a_fifth_of_all_block_bytes():
    vc = build_vllm_config("gemma-4-31b", max_model_len=32768, max_num_batched_tokens=1024, num_gpu_blocks=2188,
                           kv_transfer_config=connector_config("exact", 64 * 2**30))
    sim = build_sim_model("gemma-4-31b", vllm_config=vc, num_blocks=2188)
    drv = SchedulerDriver(build_scheduler(sim, vc), TagCopyEngine(1))
    # A 16,384-token conversation: a 16,000-token prompt and 384 generated tokens.
    drv.add([make_request("conv", tokens(5, 16_000), 384, sim.hash_block_size)])
    result = drv.run()
    assert not result.stalled and drv.idle_invariant()
    side = drv.side
    stats = side.tier.stats()
    hashed = 16_383 // 16 * 16  # tokens whose blocks carry hashes (the last sampled token is never computed)
    every_block = sum((hashed // g.block_size) * g.block_bytes for g in side.groups)
    assert stats.used_bytes <= every_block / 5, (stats.used_bytes, every_block)
    # And the full-attention group is stored whole, so the conversation can come back at its end.
    assert side._hit(_replay(sim), 16_383) > 16_000


def _replay(sim):
    # The returning turn: the whole conversation plus one new token.
    return make_request("again", tokens(5, 16_000) + [7] * 384 + [123], 1, sim.hash_block_size)
