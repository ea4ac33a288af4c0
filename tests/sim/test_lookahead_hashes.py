"""vLLM 0.34's lookahead block hashes (EAGLE/MTP): the connector opts in, so each block's key also covers the token
its drafter KV read past the block's end, and neither vLLM nor the connector has to drop the last block of a hit.

On vLLM's real scheduler (an EAGLE deployment over one full-attention group, as `sim.custom` builds it): a block is
stored only once its key exists, the next turn of the conversation loads every full block of the earlier prompt, and
a request that shares the prompt but continues with another token does not get the last block (its drafter KV was
computed from the other token). Stored KV is scoped by the lookahead: a tier written with another setting is refused.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from offload_connector.compat import hash_lookahead_tokens, lookahead_note, reprefillable_tokens, vllm_release

needs_034 = pytest.mark.skipif(vllm_release() < "0.34", reason="lookahead block hashes are new in vLLM 0.34")

BLOCK = 16
PROMPT = 10 * BLOCK  # block-aligned: its last block's key needs the first sampled token


def test_compat_reads_the_lookaheads_and_scopes_stored_kv() -> None:
    assert hash_lookahead_tokens(SimpleNamespace()) == 0 and lookahead_note(SimpleNamespace()) == ""
    cfg = SimpleNamespace(num_hash_lookahead_tokens=1, num_prefill_lookahead_tokens=3)
    assert hash_lookahead_tokens(cfg) == 1 and lookahead_note(cfg) == "; hash lookahead 1"
    # multi-module MTP re-prefills the last num_prefill_lookahead - 1 tokens: their KV is not final
    assert reprefillable_tokens(cfg) == 2 and reprefillable_tokens(SimpleNamespace(num_prefill_lookahead_tokens=1)) == 0


def test_a_disk_tier_written_with_another_lookahead_is_refused() -> None:
    from offload_connector.disk import DiskFingerprint
    from offload_connector.disk.format import FORMAT_VERSION, Header
    from offload_connector.disk.format import FingerprintMismatch
    from offload_connector.disk.index import check_fingerprint

    def fp(cfg: object) -> DiskFingerprint:
        return DiskFingerprint(model="m", group_block_bytes=(4096,), block_sizes=(16,), dtype="auto/bf16",
                               slot_bytes=4096, extra="tp 0/1 pp 0/1 layers x" + lookahead_note(cfg), vllm="0.34")

    plain, ahead = fp(SimpleNamespace()), fp(SimpleNamespace(num_hash_lookahead_tokens=1))
    assert plain.extra == "tp 0/1 pp 0/1 layers x"  # unchanged without a lookahead: older files still open
    header = Header(version=FORMAT_VERSION, epoch=1, slot_bytes=4096, stride=8192, num_slots=4, fingerprint=plain)
    check_fingerprint(header, plain)
    with pytest.raises(FingerprintMismatch, match="hash lookahead 1"):
        check_fingerprint(header, ahead)


def _driver():
    from offload_bench.sim.custom import build_custom
    from offload_bench.sim.driver import SchedulerDriver
    from offload_bench.sim.scenarios import connector_config
    from offload_bench.sim.tagcopy import TagCopier

    sched, hash_bs = build_custom([("full", BLOCK, 0)], num_blocks=400, max_num_batched_tokens=64,
                                  max_model_len=2048, kv_transfer_config=connector_config("exact", 1 << 30),
                                  num_speculative_tokens=1, spec_method="eagle")
    return SchedulerDriver(sched, TagCopier(1), spec_seed=0), hash_bs


def _drain(drv) -> None:
    res = drv.run(max_steps=5000, stall_steps=20)
    assert not res.stalled and drv.idle_invariant()


@needs_034
def test_vllm_resolves_lookahead_hashes_for_the_connector() -> None:
    from offload_connector import OffloadConnector

    assert OffloadConnector.supports_lookahead_block_hashes(None) is True
    drv, _ = _driver()
    assert drv.sched.num_hash_lookahead_tokens == 1  # EAGLE reads one token past each block
    assert drv.sched.vllm_config.num_hash_lookahead_tokens == 1


@needs_034
def test_blocks_are_keyed_with_their_next_token_and_the_next_turn_loads_them_all() -> None:
    from offload_bench.sim.requests import hash_lookahead, make_request, tokens

    drv, hbs = _driver()
    la = hash_lookahead(drv.sched)
    assert la == 1
    prompt = tokens(1, PROMPT)
    w = make_request("w", prompt, 4, hbs, hash_lookahead_tokens=la)
    drv.add([w])
    _drain(drv)
    side = drv.side
    keys = side.layout.keys(w)
    # The prompt's last block got its key from the first sampled token, and was stored under it.
    assert keys.hashed_tokens() == PROMPT
    assert all(side.tier.is_ready(keys(0, i)) for i in range(PROMPT // BLOCK))
    drv.sched.reset_prefix_cache()  # only the CPU tier holds the prompt now

    # The next turn continues the conversation: the prompt, the answer, a new message. Every block of the first
    # prompt loads, the last one included (vLLM's EAGLE drop would have cut it without lookahead hashes).
    turn = list(w.all_token_ids) + tokens(2, 40)
    r = make_request("r", turn, 2, hbs, hash_lookahead_tokens=la)
    drv.add([r])
    _drain(drv)
    loads = [a for a in side.admissions if a.request_id == "r" and a.free_after is not None]
    assert loads and loads[0].plan.hit_tokens == PROMPT

    # Same prompt, another next token: the last block's drafter KV was computed from w's token, so it is not served.
    drv.sched.reset_prefix_cache()
    other = prompt + [t + 1 if t + 1 != w.all_token_ids[PROMPT] else t + 2 for t in [w.all_token_ids[PROMPT]]]
    x = make_request("x", other + tokens(3, 40), 2, hbs, hash_lookahead_tokens=la)
    drv.add([x])
    _drain(drv)
    loads = [a for a in side.admissions if a.request_id == "x" and a.free_after is not None]
    assert loads and loads[0].plan.hit_tokens == PROMPT - BLOCK


@needs_034
@pytest.mark.parametrize("on", [True, False])
def test_the_replay_builds_deepseek_mtp_with_and_without_lookahead_hashes(on: bool) -> None:
    """`offload-connector replay --disable-lookahead-block-hashes` (DeepSeek V4's MTP) is vLLM's own switch."""
    from offload_bench.sim.layouts import build_vllm_config
    from offload_bench.sim.scenarios import connector_config

    vc = build_vllm_config("deepseek-v4-flash", max_model_len=65536, max_num_batched_tokens=1024, num_gpu_blocks=4000,
                           kv_transfer_config=connector_config("exact", 1 << 30), num_speculative_tokens=2,
                           lookahead_block_hashes=on)
    assert vc.speculative_config.disable_lookahead_block_hashes is (not on)
    assert vc.num_hash_lookahead_tokens == (1 if on else 0)
    assert reprefillable_tokens(vc) == 0  # one MTP module: the drafter reads one token ahead, nothing re-prefilled
