"""The stall scenarios: returning long-prefix requests whose loads vLLM admits together.

A warm-up request per session computes its prefix (the connector stores it), the GPU prefix cache is reset so only
the CPU tier holds it, then every session returns at once with its prefix plus new tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from offload_bench.sim.driver import DriveResult, SchedulerDriver
from offload_bench.sim.tagcopy import TagCopier
from offload_bench.sim.layouts import build_scheduler, build_sim_model, build_vllm_config
from offload_bench.sim.requests import make_request, tokens


@dataclass(frozen=True)
class StallScenario:
    model: str
    num_blocks: int
    max_num_batched_tokens: int
    max_model_len: int
    prefix_tokens: int  # the loaded prefix of each returning request
    prompt_tokens: int  # each returning request's prompt
    sessions: int
    max_tokens: int = 4
    cpu_bytes: int = 64 * 2**30
    stall_steps: int = 100  # consecutive idle zero-token steps that count as a stall
    # `num_blocks` counts blocks whose smallest group holds this many tokens (the layout the seed was measured on,
    # vLLM 0.33). A release that lays the model out in larger blocks (0.34's default block size is 64, not 16) gets
    # the same pool in bytes: proportionally fewer blocks. None: `num_blocks` as given.
    block_tokens: int | None = None


GEMMA4_SEED = StallScenario("gemma-4-31b", num_blocks=2188, max_num_batched_tokens=1024, max_model_len=32768,
                            prefix_tokens=21952, prompt_tokens=23000, sessions=2, block_tokens=16)
DEEPSEEK_V4_SEED = StallScenario("deepseek-v4-flash", num_blocks=6144, max_num_batched_tokens=1024,
                                 max_model_len=1_048_576, prefix_tokens=500_224, prompt_tokens=501_500, sessions=3,
                                 cpu_bytes=256 * 2**30, block_tokens=4)


@dataclass
class ScenarioResult:
    scenario: StallScenario
    reservation: str
    stalled: bool
    first_stall_step: int | None
    returning_completed: int
    steps: int
    free_blocks_end: int
    num_blocks: int
    loaded_tokens: int
    deferrals: int
    deferral_timeouts: int
    admissions: list[Any] = field(default_factory=list)
    snapshot: Any = None
    watchdog_detections: int = 0
    watchdog_report: Any = None  # scheduler.watchdog.StallReport of the last detection

    @property
    def pool_drained(self) -> bool:
        return self.free_blocks_end == self.num_blocks - 1


def connector_config(reservation: str, cpu_bytes: int, **extra: Any) -> Any:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector="OffloadConnector", kv_connector_module_path="offload_connector",
                            kv_role="kv_both", kv_connector_extra_config={"cpu_bytes": cpu_bytes,
                                                                          "reservation": reservation, **extra})


def plan_scenario(scn: StallScenario, kv_transfer_config: Any) -> tuple[Any, Any]:
    """The scenario's vLLM config and planned KV cache on this release, its pool the same in bytes whatever block
    size the release lays the model out in (`StallScenario.block_tokens`)."""
    def plan(num_blocks: int) -> tuple[Any, Any]:
        vc = build_vllm_config(scn.model, max_model_len=scn.max_model_len,
                               max_num_batched_tokens=scn.max_num_batched_tokens, num_gpu_blocks=num_blocks,
                               kv_transfer_config=kv_transfer_config)
        return vc, build_sim_model(scn.model, vllm_config=vc, num_blocks=num_blocks)

    vc, sim = plan(scn.num_blocks)
    smallest = min(g.kv_cache_spec.block_size for g in sim.kv_cache_config.kv_cache_groups)
    if scn.block_tokens is not None and smallest != scn.block_tokens:
        vc, sim = plan(scn.num_blocks * scn.block_tokens // smallest)
    return vc, sim


def build(scn: StallScenario, reservation: str, **extra: Any) -> tuple[SchedulerDriver, Any]:
    vc, sim = plan_scenario(scn, connector_config(reservation, scn.cpu_bytes, **extra))
    return SchedulerDriver(build_scheduler(sim, vc), TagCopier(1)), sim


def run_stall_scenario(scn: StallScenario, reservation: str, progress: Any = None, **extra: Any) -> ScenarioResult:
    drv, sim = build(scn, reservation, **extra)
    prompts = [tokens(1000 + s, scn.prompt_tokens) for s in range(scn.sessions)]
    # One token past the prefix: the window stored at the prefix boundary then ends exactly at the hit.
    for s, prompt in enumerate(prompts):
        drv.add([make_request(f"warm-{s}", prompt[: scn.prefix_tokens + 1], 1, sim.hash_block_size)])
        warm = drv.run(max_steps=drv.step_no + 10 * scn.prefix_tokens // scn.max_num_batched_tokens + 100)
        if progress is not None:
            progress(f"warm-up {s + 1}/{scn.sessions} done at step {warm.steps}")
        if warm.stalled:
            raise RuntimeError(f"warm-up {s} stalled; the scenario is misconfigured")
    drv.sched.reset_prefix_cache()
    returning = [make_request(f"return-{s}", p, scn.max_tokens, sim.hash_block_size) for s, p in enumerate(prompts)]
    drv.add(returning)
    budget = drv.step_no + 20 * (scn.sessions * scn.prompt_tokens // scn.max_num_batched_tokens) + 500
    result: DriveResult = drv.run(max_steps=budget, stall_steps=scn.stall_steps)
    side = drv.side
    done = sum(1 for r in returning if r.request_id in result.finished)
    return ScenarioResult(
        scenario=scn, reservation=reservation, stalled=result.stalled, first_stall_step=result.first_stall_step,
        returning_completed=done, steps=result.steps, free_blocks_end=drv.pool.get_num_free_blocks(),
        num_blocks=sim.kv_cache_config.num_blocks, loaded_tokens=side.counters.loaded_tokens,
        deferrals=side.counters.deferrals,
        deferral_timeouts=side.counters.deferral_timeouts,
        admissions=list(side.admissions), snapshot=side.snapshot(),
        watchdog_detections=side.watchdog.detections, watchdog_report=side.watchdog.last_report)
