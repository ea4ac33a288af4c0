"""A deferred load is not starved by requests that arrive after it (admission_policy "fair").

The scene of the issue: a gpt-oss-like layout (sliding window 128 + full attention, blocks of 16, 512-token steps),
a 600-block pool mostly held by four long decoders, a request returning with a 4,000-token prefix in the CPU tier,
and a stream of small requests arriving behind it. The load cannot fit until decoders finish; with "greedy"
admission every block that frees up goes to the small requests behind it and the load ages out (recomputed), with
"fair" the small requests wait until the load fits and it is loaded whole. vLLM's real scheduler, tag-checked copies.
"""

import pytest

from offload_bench.sim.scenarios import connector_config
from tests.decoder_scene import run


def _scene(policy: str, **extra) -> tuple:
    drv, first_token = run(connector_config("exact", 1 << 32, admission_policy=policy, **extra))
    c = drv.side.counters
    ret_loaded = any(a.request_id == "ret" and a.free_after is not None for a in drv.side.admissions)
    return drv, {"ret_loaded": ret_loaded, "aged_out": c.deferral_timeouts, "held": c.held_for_older,
                 "first_token_step": first_token, "drained": drv.idle_invariant()}


@pytest.fixture(scope="module")
def outcomes():
    return {
        # The previous default: greedy admission, a load given up after 200 deferred steps.
        "greedy-200": _scene("greedy", max_deferral_steps=200)[1],
        "greedy": _scene("greedy")[1],
        # Held from the first deferred step, so the stream of small requests cannot take a block the load needs.
        "fair": _scene("fair", fair_hold_after_steps=0)[1],
        "fair-default": _scene("fair")[1],
    }


def test_greedy_admission_with_aging_gives_the_load_up(outcomes):
    g = outcomes["greedy-200"]
    assert g["drained"]
    assert g["aged_out"] == 1 and not g["ret_loaded"]  # the small requests took every freed block until it gave up


def test_fair_admission_loads_it_and_serves_it_first(outcomes):
    f = outcomes["fair"]
    assert f["drained"]
    assert f["aged_out"] == 0 and f["ret_loaded"]
    assert f["held"] > 0  # newer requests were held back for it
    assert f["first_token_step"] < outcomes["greedy"]["first_token_step"]
    assert f["first_token_step"] < outcomes["greedy-200"]["first_token_step"]
    # With the default grace (1,000 steps before holding others back) it is loaded too, and no later than greedy.
    d = outcomes["fair-default"]
    assert d["ret_loaded"] and d["aged_out"] == 0
    assert d["first_token_step"] <= outcomes["greedy"]["first_token_step"]
