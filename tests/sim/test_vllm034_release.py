"""vLLM 0.34's sleep and `release_kv_cache_memory` with stores in flight.

0.34 discards the KV cache's physical pages (`model_executor.discard(("kv_cache",))`, the extensible KV cache's
`release_physical`) only after a completed pause, and refuses unless `scheduler.has_requests()` is false; the pause
itself steps the engine while `has_requests()` holds. A store reads the GPU blocks of its request, so it must keep
`has_requests()` true until it lands, and it does twice over: the connector delays the free of a finished request
whose stores are in flight (`request_finished` -> True), vLLM keeps such a request and its blocks in
`Scheduler.requests`, and 0.34's `has_finished_requests` counts it; and the connector's `has_pending_push_work`, which
0.34's `has_requests` also asks, is true while any store is in flight. Each is checked on its own below. After wake-up the pages are recommitted at the same addresses (its docstring: "addresses and views stay
valid"), so the worker's copy tables need no rebuild; the connector's reset (`reset_connector`, on by default) empties
the CPU tier as the GPU cache was.

Checked here in vLLM 0.34's real scheduler, with stores that take 12 steps to land."""

from __future__ import annotations

from offload_bench.sim.driver import SchedulerDriver
from offload_bench.sim.layouts import build_scheduler
from offload_bench.sim.requests import make_request, tokens
from offload_bench.sim.scenarios import StallScenario, connector_config, plan_scenario
from offload_bench.sim.tagcopy import TagCopier
from tests.sim.test_async_load_hooks import needs_034

SCN = StallScenario("gpt-oss-20b", num_blocks=1200, max_num_batched_tokens=512, max_model_len=4096,
                    prefix_tokens=1024, prompt_tokens=1024, sessions=1, cpu_bytes=1 << 30)
STORE_STEPS = 12


@needs_034
def test_a_finished_request_with_stores_in_flight_keeps_the_engine_from_releasing_its_kv_cache() -> None:
    vc, sim = plan_scenario(SCN, connector_config("exact", SCN.cpu_bytes))
    drv = SchedulerDriver(build_scheduler(sim, vc), TagCopier(1, STORE_STEPS))
    sched, side = drv.sched, drv.side
    drv.add([make_request("r", tokens(7, SCN.prompt_tokens), 1, sim.hash_block_size)])
    for _ in range(100):
        drv.step()
        if "r" in drv.finished:
            break
    assert "r" in drv.finished
    # Finished, its stores still copying its GPU blocks: the pause keeps stepping and the release refuses.
    steps = 0
    while side.jobs.store_jobs or side.jobs.pending_stores:
        assert sched.has_requests() and not sched.has_unfinished_requests()
        assert "r" in sched.requests and sched.has_finished_requests()  # the delayed free keeps its blocks
        assert sched.get_kv_connector().has_pending_push_work()  # the connector's own hold
        assert steps < 4 * STORE_STEPS, "the stores never landed"
        drv.step()
        steps += 1
    assert steps >= STORE_STEPS - 2
    drv.step()  # the step that hands vLLM the finished_sending
    # vLLM would now release the KV cache: no store reads it, and what they copied is in the tier.
    assert not sched.has_requests() and "r" not in sched.requests and len(side.tier) > 0
    assert sched.reset_prefix_cache(reset_connector=True) and len(side.tier) == 0
