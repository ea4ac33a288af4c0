"""A new second tier is one module and one registry line: a trivial in-process "memo" tier (no capacity limit, no
I/O), defined here and registered with one `SECOND_TIERS` entry, runs in the real connector (its scheduler side in
vLLM's real scheduler, its worker side in the real `OffloadWorker`) with no change anywhere else.

What it must show: the registry builds both halves from their contexts; the step messages carry its operations under
its name; a prefix evicted from a small CPU tier is read back from it, and every loaded block holds the tokens it
should (the simulation checks each load's tags); a cache reset clears it. Without the entry, the same run recomputes
that prefix."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

import pytest

from offload_connector import second_tiers
from offload_connector.keys import BlockKey
from offload_connector.metrics import OffloadStatsSink, TierMetric, TierMetrics
from offload_connector.scheduler.second_tier import PlannerContext
from offload_connector.scheduler.write_through import WriteThrough, max_writing_blocks
from offload_connector.transfer_jobs import TierRead, TierStep
from offload_connector.worker.second_tier import ClientContext

from offload_bench.sim.driver import SchedulerDriver
from offload_bench.sim.layouts import build_scheduler
from offload_bench.sim.requests import make_request, tokens
from offload_bench.sim.scenarios import StallScenario, connector_config, plan_scenario
from offload_bench.sim.tagcopy import TagCopier

MEMO = "memo"

# --- the whole tier: its metrics (what the Prometheus side registers for it, what it reports under) ----------------

MEMO_METRICS = TierMetrics(
    name=MEMO,
    planner_totals=(TierMetric("memo_tier_read_back_blocks", "memo_tier_read_back_blocks_total",
                               "Blocks read back from the memo tier into the CPU tier for loads that landed."),),
    io=(TierMetric("memo_tier_written_bytes", "memo_tier_written_bytes_total", "Bytes written to the memo tier."),
        TierMetric("memo_tier_read_bytes", "memo_tier_read_bytes_total", "Bytes read from the memo tier."),
        TierMetric("memo_tier_failures", "memo_tier_failures_total", "Memo-tier operations that failed.")),
)


# --- the whole tier: a scheduler-side planner and a worker-side client ------------------------------------------

class MemoPlanner:
    """Holds every key a write-through landed on every worker; reads any of them back."""
    name = MEMO
    local = True

    def __init__(self, ctx: PlannerContext) -> None:
        self.tier = ctx.tier
        self.writes = WriteThrough(ctx.tier, ctx.reporters, max_writing_blocks(ctx.tier.capacity_slots))
        self.held: set[BlockKey] = set()
        self.read_back_blocks = 0
        self._clear = False

    def extend_ready(self, ready: Callable[[BlockKey], bool], *_: Any) -> Callable[[BlockKey], bool]:
        return lambda key: ready(key) or self.can_read(key)

    def can_read(self, key: BlockKey) -> bool:
        return key in self.held and not self.tier.has(key)

    def start_read(self, request_id: str, keys: list[BlockKey]) -> tuple[Callable[..., None], object]:
        return self._read_done, list(keys)

    def _read_done(self, keys: list[BlockKey], ok: bool, retired: bool = False) -> None:
        if ok and not retired:
            self.read_back_blocks += len(keys)

    def forget(self, request_id: str) -> None:
        pass

    def stored(self, keys: Sequence[BlockKey], job_id: int) -> None:
        chosen: list[BlockKey] = []
        for key in keys:
            if key not in self.held and self.writes.has_room(len(chosen)):
                chosen.append(key)
        if chosen:
            self.writes.issue(job_id, chosen)

    def write_finished(self, job_id: int, ok: bool) -> None:
        keys = self.writes.report(job_id, ok)
        if keys and ok:
            self.held.update(keys)

    def take_step(self) -> TierStep:
        out = TierStep(clear=self._clear, writes=self.writes.take())
        self._clear = False
        return out

    def clear(self) -> None:
        self.writes.clear()
        self.held.clear()
        self._clear = True

    def after_tier_clear(self) -> None:
        self.writes.after_tier_clear()

    def busy(self) -> bool:
        return self.writes.busy() or self._clear

    def record_stats(self, stats: OffloadStatsSink) -> None:
        stats.record_second_tier(MEMO_METRICS, (self.read_back_blocks,))

    def describe(self) -> str:
        return "in process memory"


@dataclass
class _Done:
    ok: bool = True
    error: str | None = None

    def done(self) -> bool:
        return True


@dataclass
class MemoClient:
    """Copies the CPU tier's slots (here the simulation's tags: `TagCopier.host`, slot -> tag) at once."""
    slots: dict[int, Hashable]
    name: str = MEMO
    values: dict[BlockKey, Hashable] = field(default_factory=dict)
    steps: list[TierStep] = field(default_factory=list)
    _done: list[int] = field(default_factory=list)

    def apply(self, step: TierStep) -> None:
        self.steps.append(step)
        if step.clear:
            self.values.clear()
        for write in step.writes:
            for key, slot in zip(write.keys, write.host_slots):
                self.values[key] = self.slots.get(slot)
            self._done.append(write.job_id)

    def read_back(self, read: TierRead) -> list[_Done]:
        for key, slot in zip(read.keys, read.slots):
            self.slots[slot] = self.values[key]
        return [_Done()]

    def finished_writes(self) -> tuple[list[int], list[int]]:
        done, self._done = self._done, []
        return done, []

    def io_deltas(self) -> tuple[int, int, int]:
        return 0, 0, 0

    def rejected(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass


built: dict[str, Any] = {}


def open_memo_planner(ctx: PlannerContext) -> MemoPlanner:
    built["planner"] = MemoPlanner(ctx)
    return built["planner"]


def open_memo_client(ctx: ClientContext) -> MemoClient:
    built["client"] = MemoClient(built["copier"].host)
    return built["client"]


# --- the run ------------------------------------------------------------------------------------------------------

# gpt-oss-20b (window 128 + full attention, 16-token blocks): two 2,048-token prefixes, a CPU tier of about 1.5 of them,
# so the second evicts the first before both return.
SCN = StallScenario("gpt-oss-20b", num_blocks=1200, max_num_batched_tokens=512, max_model_len=4096,
                    prefix_tokens=2048, prompt_tokens=2300, sessions=2, cpu_bytes=210 * 393216)


def _run(register: bool, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    built.clear()
    if register:
        monkeypatch.setitem(second_tiers.SECOND_TIERS, MEMO, (f"{__name__}:open_memo_planner",
                                                              f"{__name__}:open_memo_client",
                                                              f"{__name__}:MEMO_METRICS"))
    built["copier"] = copier = TagCopier(1)
    vc, sim = plan_scenario(SCN, connector_config("exact", SCN.cpu_bytes))
    drv = SchedulerDriver(build_scheduler(sim, vc), copier)
    prompts = [tokens(2000 + s, SCN.prompt_tokens) for s in range(SCN.sessions)]
    for s, prompt in enumerate(prompts):
        drv.add([make_request(f"warm-{s}", prompt[: SCN.prefix_tokens + 1], 1, sim.hash_block_size)])
        assert not drv.run(max_steps=drv.step_no + 400).stalled
    drv.sched.reset_prefix_cache()
    drv.add([make_request(f"return-{s}", p, 4, sim.hash_block_size) for s, p in enumerate(prompts)])
    result = drv.run(max_steps=drv.step_no + 2000)
    assert not result.stalled and {"return-0", "return-1"} <= result.finished
    return {"loaded": drv.side.counters.loaded_tokens, "side": drv.side, "driver": drv}


def test_a_trivial_third_tier_is_one_registry_line(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = _run(False, monkeypatch)
    assert MEMO not in plain["side"].second_tiers and not built.get("planner")
    with_memo = _run(True, monkeypatch)
    side, planner, client = with_memo["side"], built["planner"], built["client"]
    # Both halves came from the registry, and the worker got the tier's operations under its name.
    assert side.second_tiers == {MEMO: planner} and with_memo["driver"].worker.second_tiers == {MEMO: client}
    assert sum(len(w.keys) for s in client.steps for w in s.writes) == len(client.values) > 0
    # The evicted prefix came back from the memo tier (every loaded block's tag checked by the driver), so more was
    # loaded than with the CPU tier alone, which had to recompute it.
    assert planner.read_back_blocks > 0
    # It reports under the metrics it declared.
    sink = OffloadStatsSink()
    planner.record_stats(sink)
    assert sink.take().data["counters"] == {"memo_tier_read_back_blocks": planner.read_back_blocks}
    assert with_memo["loaded"] > plain["loaded"], (with_memo["loaded"], plain["loaded"])
    # A cache reset reaches it: the planner forgets, the next step tells the workers to.
    assert side.reset_cache()
    with_memo["driver"].step()
    assert not planner.held and client.steps[-1].clear and not client.values
