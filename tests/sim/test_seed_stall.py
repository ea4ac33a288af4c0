"""The seed scenarios through vLLM's real Scheduler: vLLM's reservation stalls, ours completes every request."""

import pytest

from offload_bench.sim.scenarios import DEEPSEEK_V4_SEED, GEMMA4_SEED, run_stall_scenario


def check_admissions_exact(result):
    assert result.admissions, "no load was admitted"
    for adm in result.admissions:
        assert adm.free_before - adm.free_after == sum(adm.plan.now), adm
        assert adm.entries_after == adm.plan.entries, adm
        assert adm.live_after == adm.plan.live, adm


@pytest.fixture(scope="module")
def gemma_results():
    # The watchdog threshold sits below the driver's stall verdict (100 idle steps) so it has time to fire.
    return {mode: run_stall_scenario(GEMMA4_SEED, mode, stall_watchdog_steps=20) for mode in ("vllm", "exact")}


def test_gemma4_vllm_reservation_stalls(gemma_results):
    r = gemma_results["vllm"]
    assert r.stalled and r.first_stall_step is not None
    assert r.returning_completed == 0
    # Both loads were admitted side by side: 2 x 1006 blocks of the 2,187 usable, leaving 175.
    assert [sum(a.plan.now) for a in r.admissions] == [1006, 1006]
    assert r.free_blocks_end == 175
    # The ledger knows why: the two loaded requests still need 363 blocks each (5 x 66 sliding + 33 full).
    assert sorted(sum(row.remaining) for row in r.snapshot.rows) == [363, 363]


def test_watchdog_catches_the_vllm_reservation_stall_and_names_the_holders(gemma_results):
    r = gemma_results["vllm"]
    assert r.watchdog_detections == 1  # once per stall, not once per idle step
    report = r.watchdog_report
    assert report.idle_steps == 20 and report.waiting == 2 and report.snapshot.free_blocks == 175
    assert sorted(h.request_id for h in report.holders) == ["return-0", "return-1"]
    assert [sum(h.held) for h in report.holders] == [1006, 1006]
    assert "holds 1006 blocks" in report.describe()


def test_watchdog_never_fires_in_exact_mode(gemma_results):
    assert gemma_results["exact"].watchdog_detections == 0


def test_gemma4_exact_reservation_completes(gemma_results):
    r = gemma_results["exact"]
    assert not r.stalled
    assert r.returning_completed == GEMMA4_SEED.sessions
    assert r.pool_drained
    assert r.loaded_tokens == 2 * GEMMA4_SEED.prefix_tokens
    assert r.deferrals > 0  # the second load had to wait for the first request's blocks
    check_admissions_exact(r)
    # The exact per-group numbers of the seed: 5 x 64 sliding + 686 full now; then, counted from the first block
    # still in the window at the hit (block 1,308 of the 1,438 the 23,001-token target spans), 130 - 64 = 66 more
    # per sliding group (below the 193-block ceiling) and 33 full.
    plan = r.admissions[0].plan
    assert plan.now == (64, 64, 64, 64, 64, 686)
    assert plan.remaining == (66, 66, 66, 66, 66, 33)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["vllm", "exact"])
def test_deepseek_v4_flash_500k(mode):
    r = run_stall_scenario(DEEPSEEK_V4_SEED, mode, stall_watchdog_steps=20)
    assert r.watchdog_detections == (1 if mode == "vllm" else 0)
    if mode == "vllm":
        assert r.stalled and r.returning_completed < DEEPSEEK_V4_SEED.sessions
        assert r.free_blocks_end < 420  # less than one 1024-token chunk of the packed groups
    else:
        assert not r.stalled
        assert r.returning_completed == DEEPSEEK_V4_SEED.sessions
        assert r.pool_drained
        assert r.loaded_tokens == DEEPSEEK_V4_SEED.sessions * DEEPSEEK_V4_SEED.prefix_tokens
        check_admissions_exact(r)


def test_aged_deferral_falls_back_to_recompute():
    # With a 3-step deferral limit the second returning request stops waiting for the pool and recomputes.
    r = run_stall_scenario(GEMMA4_SEED, "exact", max_deferral_steps=3)
    assert not r.stalled and r.pool_drained
    assert r.returning_completed == GEMMA4_SEED.sessions
    assert r.deferral_timeouts == 1
    assert r.loaded_tokens == GEMMA4_SEED.prefix_tokens  # only the first load happened
