"""A load waiting for room keeps its CPU-tier entries: every step it is deferred they are touched, so the stores of
the requests that run meanwhile evict other entries first.

The scene of tests/test_fair_admission.py (gpt-oss-like layout, four decoders holding most of a 600-block pool, a
request returning with a 4,000-token prefix, small requests streaming in behind it), with a CPU tier too small to
hold the prefix and everything the small requests store while the load waits. vLLM's real scheduler, tag-checked
copies. Without the touches the prefix is evicted from its tail while it waits and the load that finally runs is a
fraction of it or nothing: the second test runs the same scene with the touches patched out.
"""

import pytest

from offload_connector.scheduler.admission import AdmissionControl
from offload_bench.sim.custom import build_custom
from offload_bench.sim.driver import SchedulerDriver
from offload_bench.sim.requests import make_request, tokens
from offload_bench.sim.scenarios import connector_config
from offload_bench.sim.tagcopy import TagCopier

GROUPS = (("full", 16, 0), ("sliding", 16, 128))
PREFIX = 4000


def _scene(cpu_slots: int) -> dict:
    probe, _ = build_custom(GROUPS, num_blocks=600, max_num_batched_tokens=512, max_model_len=8192,
                            kv_transfer_config=connector_config("exact", 1 << 32))
    slot_bytes = probe.get_kv_connector().scheduler_side.slot_bytes
    sched, hbs = build_custom(GROUPS, num_blocks=600, max_num_batched_tokens=512, max_model_len=8192,
                              kv_transfer_config=connector_config("exact", cpu_slots * slot_bytes))
    drv = SchedulerDriver(sched, TagCopier(1))
    prefix = tokens(1, PREFIX)
    drv.add([make_request("warm", prefix, 1, hbs)])
    assert not drv.run().stalled
    sched.reset_prefix_cache()
    drv.add([make_request(f"dec{i}", tokens(10 + i, 1500), 600 + 40 * i, hbs) for i in range(4)])
    for _ in range(20):
        drv.step()
    drv.add([make_request("ret", prefix + tokens(2, 60), 4, hbs)])
    n = 0
    while drv.busy() and drv.step_no < 6000:
        if drv.step_no % 3 == 0 and n < 600:
            drv.add([make_request(f"small{n}", tokens(100 + n, 100), 8, hbs)])
            n += 1
        rec = drv.step()
        assert not (rec.idle_while_waiting and not drv.busy())
    side = drv.side
    loads = [a for a in side.admissions if a.request_id == "ret" and a.free_after is not None]
    return {"hit": loads[0].plan.hit_tokens if loads else 0, "deferrals": side.counters.deferrals,
            "evictions": side.tier.evictions, "drained": drv.idle_invariant()}


SLOTS = 900  # holds the prefix (about 260 slots) until it returns, not everything stored while it waits


def test_a_deferred_load_is_not_evicted_while_it_waits():
    r = _scene(SLOTS)
    assert r["drained"]
    assert r["deferrals"] > 50  # it did wait for the decoders
    assert r["evictions"] > 5 * SLOTS  # and the tier turned over several times meanwhile
    assert r["hit"] >= PREFIX - 64  # yet the prefix was loaded whole (to its last restorable point)


def test_without_the_touches_the_same_wait_loses_the_prefix(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(AdmissionControl, "_keep_warm", lambda self, request, local, hit: None)
    r = _scene(SLOTS)
    assert r["drained"] and r["deferrals"] > 0
    assert r["hit"] < PREFIX // 2
