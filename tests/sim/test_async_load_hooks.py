"""The hooks vLLM asks a connector about async loads, on vLLM's real scheduler with tag-checked copies.

- Requests whose external hit vLLM discards (prompt logprobs: 0.34's `skip_reading_external_kv`, 0.32/0.33's
  `skip_reading_prefix_cache`) are answered 0 without a lookup, a deferral or a fairness hold.
- `may_load_async` (0.34) is a side-effect-free probe of this host's tiers.
- With 0.34's `--max-num-inflight-kv-loads`, loads start while the running batch is full, and a load vLLM holds back
  after we admitted it waits as a deferred load does (reason `not_started`).
- `get_external_cache_hit_sources` splits a load's tokens by the tier that held them.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from offload_bench.sim import full_batch
from offload_bench.sim.full_batch import PREFIX, warm
from offload_bench.sim.requests import make_request, tokens
from offload_bench.sim.vllm_compat import has_inflight_load_cap
from offload_connector.scheduler.admission import AdmissionControl


needs_034 = pytest.mark.skipif(not has_inflight_load_cap(), reason="--max-num-inflight-kv-loads is new in vLLM 0.34")


def test_requests_vllm_reads_no_external_kv_for_are_answered_zero_without_a_lookup() -> None:
    drv, hbs, prefix = warm()
    side = drv.side
    plain = make_request("plain", prefix + tokens(2, 40), 4, hbs)
    logprobs = make_request("logprobs", prefix + tokens(2, 40), 4, hbs, prompt_logprobs=1)
    for r in (plain, logprobs):
        side.on_new_request(r)
    before = (side.counters.lookups, side.counters.deferrals, side.counters.held_for_older)
    assert side.get_num_new_matched_tokens(logprobs, 0) == (0, False)
    assert (side.counters.lookups, side.counters.deferrals, side.counters.held_for_older) == before
    assert not side.may_load_async(logprobs)
    got, is_async = side.get_num_new_matched_tokens(plain, 0)
    assert is_async and got >= PREFIX - 128  # the twin without prompt logprobs loads
    # Through the scheduler: the logprobs request computes its whole prompt and finishes; nothing is left pinned.
    drv.add([make_request("logprobs-2", prefix + tokens(3, 40), 2, hbs, prompt_logprobs=1)])
    assert not drv.run().stalled
    assert drv.idle_invariant()


def test_may_load_async_probes_the_tiers_without_side_effects() -> None:
    drv, hbs, prefix = warm()
    side = drv.side
    back = make_request("back", prefix + tokens(2, 40), 4, hbs)
    cold = make_request("cold", tokens(9, PREFIX), 4, hbs)
    short = make_request("short", prefix[:8] + tokens(4, 200), 4, hbs)  # half a block: nothing to load
    for r in (back, cold, short):
        side.on_new_request(r)
    state = side._requests["back"]
    # Counters, the junctions noted, and the tier's eviction order (a touch would move the prefix's entries).
    before = (side.counters.lookups, side.counters.hits, side.counters.cpu_hit_tokens, set(state.junctions),
              state.unshared, tuple(side.tier.evictable_keys()))
    assert side.may_load_async(back)
    assert not side.may_load_async(cold)
    assert not side.may_load_async(short)
    after = (side.counters.lookups, side.counters.hits, side.counters.cpu_hit_tokens, set(state.junctions),
             state.unshared, tuple(side.tier.evictable_keys()))
    assert after == before
    # The probe and the lookup agree on what the tier holds.
    assert side.admission.probe(back) == side.admission.hit(back, back.num_tokens - 1)


@needs_034
def test_loads_start_while_the_batch_is_full_with_the_inflight_cap() -> None:
    on, off = full_batch.run(override=True, inflight=2), full_batch.run(override=False, inflight=2)
    assert on.drained and off.drained and None not in on.first_token_steps + off.first_token_steps
    assert on.loaded_tokens == off.loaded_tokens > 0
    # Without the override the loads wait for a running slot, i.e. for a decoder to finish (150+ steps).
    assert off.first_load_step > 100
    assert on.first_load_step < 10, (on, off)


@needs_034
def test_a_load_vllm_holds_back_after_admission_waits_as_a_deferred_load() -> None:
    capped = full_batch.run(override=True, inflight=1)
    assert capped.drained and None not in capped.first_token_steps
    # The second returning load was admitted by the ledger while the first one held vLLM's only load slot.
    assert capped.not_started > 0
    # It waited for the slot instead of being given up; the first load then put the shared prefix in the GPU prefix
    # cache, which served the second request.
    assert capped.aged_out == 0 and capped.loaded_tokens >= full_batch.PREFIX - 128


def test_hit_sources_split_a_load_by_the_farthest_tier_covering_each_token() -> None:
    # Two groups: full attention in blocks of 16, a window in blocks of 32. Keys name their tier.
    groups = (SimpleNamespace(block_size=16), SimpleNamespace(block_size=32))
    tiers = {"h": (True, False), "d": (False, True), "s": (False, False)}
    me = SimpleNamespace(layout=SimpleNamespace(groups=groups),
                         tier=SimpleNamespace(is_ready=lambda k: tiers[k[0]][0]),
                         second_tiers=(SimpleNamespace(name="disk", can_read=lambda k: tiers[k[0]][1]),
                                       SimpleNamespace(name="shared", can_read=lambda k: True)))
    me._source = lambda key: AdmissionControl._source(me, key)

    def split_(groups_: list[int], indices: list[int], keys: list[str], local: int, hit: int) -> dict[str, int]:
        return AdmissionControl._hit_sources(me, groups_, indices, [me._source(k) for k in keys], local, hit)
    # Tokens 32..96: full blocks 2..5 (host, host, disk, host); window block 2 (64..96) from the shared tier.
    groups_ = [0, 0, 0, 0, 1]
    indices = [2, 3, 4, 5, 2]
    keys = ["h2", "h3", "d4", "h5", "s2"]
    split = split_(groups_, indices, keys, 32, 96)
    assert split == {"host": 32, "shared": 32}
    # Without the window block, the disk block's 16 tokens count for the disk.
    split = split_(groups_[:4], indices[:4], keys[:4], 32, 96)
    assert split == {"host": 48, "disk": 16}
    # Tokens no loaded block covers (below a window, no full attention) go to the load's farthest tier.
    split = split_([1], [2], ["d2"], 0, 96)
    assert split == {"disk": 96}
    assert sum(split_([0], [0], ["h0"], 0, 16).values()) == 16
    # Against a walk over every token, on random loads.
    rng = random.Random(7)
    for _ in range(200):
        local = rng.randrange(0, 6) * 16
        hit = local + rng.randrange(1, 12) * 32
        picks = [(g, i) for g in (0, 1) for i in range(hit // groups[g].block_size) if rng.random() < 0.6]
        keys = [rng.choice("hds") + str(i) for _, i in picks]
        got = split_([g for g, _ in picks], [i for _, i in picks], keys, local, hit)
        rank = [-1] * (hit - local)
        for (g, i), k in zip(picks, keys):
            bs = groups[g].block_size
            for t in range(max(local, i * bs), min(hit, (i + 1) * bs)):
                rank[t - local] = max(rank[t - local], "hds".index(k[0]))
        far = max(rank, default=0)
        want = {}
        for r in rank:
            name = ("host", "disk", "shared")[far if r < 0 else r]
            want[name] = want.get(name, 0) + 1
        assert got == want, (local, hit, picks, keys)


def test_the_connector_reports_a_cpu_tier_load_as_host() -> None:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    drv, hbs, prefix = warm()
    conn = drv.sched.get_kv_connector()
    ret = make_request("ret", prefix + tokens(2, 40), 2, hbs)
    drv.add([ret])
    while drv.side.counters.loads_admitted == 0:
        drv.step()
    n = drv.side.counters.loaded_tokens
    assert n > 0
    assert conn.get_external_cache_hit_sources(ret, n) == {CacheHitSource.HOST: n}
    assert conn.get_external_cache_hit_sources(ret, 0) == {}
    assert not drv.run().stalled
