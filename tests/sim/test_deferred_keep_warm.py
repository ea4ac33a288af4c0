"""A load waiting for room keeps its CPU-tier entries: every step it is deferred they are touched, so the stores of
the requests that run meanwhile evict other entries first.

The scene of tests/sim/test_fair_admission.py (gpt-oss-like layout, four decoders holding most of a 600-block pool, a
request returning with a 4,000-token prefix, small requests streaming in behind it), with a CPU tier too small to
hold the prefix and everything the small requests store while the load waits. vLLM's real scheduler, tag-checked
copies. Without the touches the prefix is evicted from its tail while it waits and the load that finally runs is a
fraction of it or nothing: the second test runs the same scene with the touches patched out.
"""

import pytest

from offload_connector.scheduler.admission import AdmissionControl
from offload_bench.sim.scenarios import connector_config
from offload_bench.sim.starved import PREFIX, build, run


# The tier is sized in slots for the prefix stored with checkpoints 8,192 tokens apart (its end window only); the
# layout's derived spacing (128 tokens on this gpt-oss-like layout) stores a window every 128 tokens and changes what
# fits, so the scene pins the spacing it was sized for.
SPACING = 8192


def _scene(cpu_slots: int) -> dict:
    probe, _ = build(connector_config("exact", 1 << 32, window_checkpoint_tokens=SPACING))
    slot_bytes = probe.get_kv_connector().scheduler_side.slot_bytes
    drv, _ = run(connector_config("exact", cpu_slots * slot_bytes, window_checkpoint_tokens=SPACING))
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
    monkeypatch.setattr(AdmissionControl, "_keep_warm", lambda self, offer: None)
    r = _scene(SLOTS)
    assert r["drained"] and r["deferrals"] > 0
    assert r["hit"] < PREFIX // 2
