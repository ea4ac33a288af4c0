"""Scheduler side of the connector: the facade vLLM's scheduler calls, wiring the parts together.

Lives in vLLM's scheduler process. It never imports CUDA and only hands plain `OffloadMetadata` to the workers.
The parts: `admission` (lookup, the exact ledger, fairness, issuing loads), `stores` (which blocks go to the tier),
`jobs` (copies in flight and what each releases when it finishes), `state` (what they share).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import TYPE_CHECKING

from offload_connector.config import OffloadConfig
from offload_connector.groups import GroupInfo, check_against_manager, tier_slots
from offload_connector.log import get_logger
from offload_connector.metadata import OffloadMetadata, OffloadWorkerMetadata
from offload_connector.metrics import OffloadStats, OffloadStatsSink
from offload_connector.scheduler import ledger
from offload_connector.scheduler.admission import Admission, AdmissionControl
from offload_connector.scheduler.events import TierEvents, events_enabled
from offload_connector.scheduler.second_tier import PlannerContext, SecondTierPlanner
from offload_connector.second_tiers import SECOND_TIERS, tier_factory
from offload_connector.scheduler.fairness import FairQueue
from offload_connector.scheduler.jobs import JobBook
from offload_connector.scheduler.state import KVBinding, Layout, ReqState, SchedulerCounters
from offload_connector.scheduler.ranking import eviction_order, spare_order
from offload_connector.scheduler.stores import StorePlanner
from offload_connector.scheduler.tier_index import TierIndex
from offload_connector.scheduler.view import SchedulerView, build_view
from offload_connector.scheduler.watchdog import StallReport, StallWatchdog
from offload_connector.scheduler.windows import checkpoint_spacing

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["Admission", "OffloadScheduler", "SchedulerCounters", "SchedulerView"]

logger = get_logger(__name__)


class OffloadScheduler:
    def __init__(self, config: OffloadConfig, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
        layout = Layout.from_vllm(vllm_config, kv_cache_config)
        derived_spacing = config.window_checkpoint_tokens is None
        if derived_spacing:  # every part (stores, the shared tier's lookups) reads one resolved number
            config = dataclasses.replace(config, window_checkpoint_tokens=checkpoint_spacing(layout.groups,
                                                                                             layout.alignment))
        self.config = config
        self.layout = layout
        # Plain attributes as before the split: tests, simulations and the connector read them.
        self.max_model_len = layout.max_model_len
        self.num_spec_tokens = layout.num_spec_tokens
        self.num_lookahead_tokens = layout.num_lookahead_tokens
        self.groups: list[GroupInfo] = list(layout.groups)
        self.alignment = layout.alignment
        self.hash_block_size = layout.hash_block_size
        self.num_blocks = layout.num_blocks
        pc = vllm_config.parallel_config
        self.reporters = max(1, pc.tensor_parallel_size * pc.pipeline_parallel_size)
        capacity, self.slot_bytes = tier_slots(config.cpu_bytes, kv_cache_config)
        self.tier = TierIndex(capacity, [g.block_bytes for g in self.groups], policy=config.eviction)
        policy = getattr(getattr(vllm_config, "scheduler_config", None), "policy", "fcfs")
        self.fair = FairQueue(priority_policy=str(getattr(policy, "value", policy)) == "priority",
                              grace_steps=config.fair_hold_after_steps)
        self.counters = SchedulerCounters()
        self.stats = OffloadStatsSink()
        self.watchdog = StallWatchdog(config.stall_watchdog_steps)
        self._step = 0
        self._load_fences: list[int] = []  # loads reported since the last step (load_completion "ordered")
        self._requests: dict[str, ReqState] = {}
        # KV cache events for the tier (medium "CPU"), drained by take_events(); only when --kv-events-config
        # enables them.
        self._events = TierEvents(events_enabled(vllm_config), self.groups, kv_cache_config)
        self.tier.on_removed = self._events.removed if self._events.enabled else None
        self.jobs = JobBook(self.tier, self._events, self.reporters)
        self.admission = AdmissionControl(config, layout, self.tier, self._requests, self.jobs, self.counters,
                                          self.stats, self.fair)
        cache_config = getattr(vllm_config, "cache_config", None)
        self.admission.mark_junctions = getattr(cache_config, "prefix_cache_retention_interval", None) is not None
        self.stores = StorePlanner(config, layout, self.tier, self.jobs, self._events, self.counters)
        # The second tiers the config turns on, in read order (`second_tiers.py`), each by its name in the step
        # messages.
        ctx = PlannerContext(config, vllm_config, kv_cache_config, tuple(self.groups), self.tier, self.reporters,
                             self.slot_bytes)
        self.second_tiers: dict[str, SecondTierPlanner] = {}
        for name in SECOND_TIERS:
            planner = tier_factory(name, "scheduler")(ctx)
            if planner is not None:
                self.second_tiers[planner.name] = planner
                self.jobs.on_stored.append(planner.stored)
        self.admission.second_tiers = tuple(self.second_tiers.values())
        self.resets = 0
        # Until the first step, ask vLLM for one (has_pending_work): its stats carry the tier's capacity to
        # /metrics right after start-up instead of after the first request.
        self._startup_step_pending = True
        logger.info(
            "offload_connector scheduler side: CPU tier %s per worker = %d slots x %d bytes, shared by %d KV cache "
            "groups (one slot = one block of one group; %s); reservation %s, admission %s%s, eviction %s, "
            "window checkpoints every %d tokens%s, min load %d tokens, KV cache events %s; second tiers: %s",
            _fmt_bytes(config.cpu_bytes), capacity, self.slot_bytes, len(self.groups),
            "; ".join(f"group {g.index}: {g.kind.value}"
                      + (f" {g.sliding_window}" if g.sliding_window else "")
                      + (f" chunk {g.chunk_size}" if g.chunk_size else "")
                      + f", {g.num_layers} layers, {g.block_size}-token blocks of {g.block_bytes} bytes"
                      for g in self.groups),
            config.reservation, config.admission_policy,
            f" (a deferred load holds newer requests back while it waits for them, and all of them after "
            f"{config.fair_hold_after_steps} steps)"
            if config.admission_policy == "fair" else "",
            config.eviction, config.window_checkpoint_tokens, " (derived from the layout)" if derived_spacing else "",
            config.min_load_tokens,
            "on" if self.events.enabled else "off",
            "; ".join(f"{name} {t.describe()}" for name, t in self.second_tiers.items()) or "none")

    # ------------------------------------------------------------------ binding
    def bind(self, kv_cache_manager: KVCacheManager) -> None:
        managers = tuple(kv_cache_manager.coordinator.single_type_managers)
        check_against_manager(self.groups, managers)
        kv = KVBinding(managers, kv_cache_manager.block_pool, kv_cache_manager,
                       int(getattr(kv_cache_manager, "watermark_blocks", 0) or 0))
        self.admission.bind(kv)
        self.stores.bind(kv)

    def on_new_request(self, request: Request) -> None:
        self._requests[request.request_id] = ReqState(request, [0] * len(self.groups),
                                                      window_next=[0] * len(self.groups))

    # --------------------------------------------------------------- admission
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._requests.get(request.request_id)
        if state is None:  # a request we were not told about (should not happen); track it now
            self.on_new_request(request)
            state = self._requests[request.request_id]
        if request.request_id in self.jobs.loads or skips_external_kv(request):
            return 0, False
        return self.admission.match(request, state, num_computed_tokens, self._step)

    def may_load_async(self, request: Request) -> bool:
        """vLLM 0.34 asks this as a request enters the waiting queues (with `--max-num-inflight-kv-loads`): True puts
        it in the queue whose loads may start while the running batch is full. Side-effect free: the tiers of this
        host hold at least `min_load_tokens` of its prompt, as the lookup would find them now."""
        state = self._requests.get(request.request_id)
        if (state is not None and state.no_load) or skips_external_kv(request):
            return False
        return self.admission.probe(request) >= max(1, self.config.min_load_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        self.admission.start_load(request, self._requests[request.request_id], blocks, num_external_tokens)

    def hit_sources(self, request_id: str) -> dict[str, int]:
        """The tokens of the request's last load by tier ("host", "disk", "shared")."""
        state = self._requests.get(request_id)
        return dict(state.hit_sources) if state is not None else {}

    def plan_load(self, request: Request, hit: int, local_blocks: list[list[KVCacheBlock]]) -> ledger.LoadPlan:
        """Exact per-group blocks a load of `hit` tokens takes now and may still take through its prompt."""
        return self.admission.plan_load(request, hit, local_blocks)

    def snapshot(self) -> ledger.LedgerSnapshot:
        return self.admission.snapshot(self._step)

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        rid = request.request_id
        state = self._requests.get(rid)
        if state is None:
            return False, None
        state.finished = True
        self.fair.clear(rid)
        for second in self.second_tiers.values():
            second.forget(rid)
        # Aborted while its load was in flight: the copy still targets the request's blocks, which vLLM itself
        # keeps until the load reports in finished_recving (finish_requests, WAITING_FOR_REMOTE_KVS) and then
        # frees. The tier entries stay pinned until the worker reports the job (see update_connector_output).
        load = self.jobs.orphan(rid)
        if request.num_computed_tokens > 0 and load is None:
            self.stores.plan(state, request.num_computed_tokens, [list(ids) for ids in block_ids])
        # Delay the free only for stores that read the blocks vLLM is about to free. With a load in flight vLLM
        # already delays the free until finished_recving and frees the blocks then: a finished_sending for the same
        # request would free them a second time (vLLM asserts the request still exists). Any store pending then was
        # issued before a preemption, from blocks vLLM freed at the preemption; the fences cover those.
        if state.pending_stores and load is None:
            self.jobs.delay_free(rid)
            return True, None  # ranked when its last store lands (`_finish_store`)
        self._rank_for_eviction(state)
        del self._requests[rid]
        return False, None

    def _rank_for_eviction(self, state: ReqState) -> None:
        # Once, when the request is done with the tier: an entry still being stored would be released later as the
        # newest and escape the order.
        tier, keys = self.tier, self.layout.keys(state.request)
        tier.rank(eviction_order(self.groups, keys, lambda k: tier.has(k) and not tier.is_spare(k), self.alignment))
        tier.rank(spare_order(self.groups, keys, tier.is_spare))

    # ------------------------------------------------------------- step output
    def build_meta(self, scheduler_output: SchedulerOutput) -> OffloadMetadata:
        self._step += 1
        self._startup_step_pending = False
        # Fences look only at stores issued in earlier steps: this step's stores read after this step's forward.
        fences = self.jobs.fences(scheduler_output)
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            state = self._requests.get(rid)
            if state is None or rid in self.jobs.loads:
                continue
            state.gated_unscheduled = False
            self.stores.plan(state, state.request.num_computed_tokens + n, None)
        self._watch(scheduler_output)
        loads, stores, delayed_free = self.jobs.take_step()
        load_fences, self._load_fences = tuple(self._load_fences), []
        return OffloadMetadata(step=self._step, loads=loads, stores=stores, delayed_free=delayed_free,
                               store_fences=fences, load_fences=load_fences, tier_slots=self.tier.capacity_slots,
                               tier_steps={name: t.take_step() for name, t in self.second_tiers.items()})

    def _watch(self, scheduler_output: SchedulerOutput) -> None:
        # With no token scheduled nothing runs, so every unfinished request is waiting.
        waiting = sum(1 for st in self._requests.values() if not st.finished)
        detected = self.watchdog.observe(scheduler_output.total_num_scheduled_tokens, waiting, self.jobs.in_flight())
        if detected:
            self.watchdog.report(StallReport(self._step, self.watchdog.idle_steps, waiting, self.snapshot(),
                                             self.admission.holders()))
        self.stats.record_stall_state(self.watchdog.stalled, detected)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        meta = getattr(output, "kv_connector_worker_meta", None)
        if isinstance(meta, OffloadWorkerMetadata):  # before the failures they explain: their slots stay held
            self.jobs.reads_abandoned(meta.reads_abandoned)
        for rid in output.finished_recving or ():
            self._finish_load(rid, ok=rid not in (getattr(output, "failed_recving", None) or ()))
        if isinstance(meta, OffloadWorkerMetadata):
            self.jobs.reads_settled(meta.reads_settled)
            for job_id in meta.stores_done:
                self._finish_store(job_id, ok=True)
            for job_id in meta.stores_failed:
                self._finish_store(job_id, ok=False)
            for name, job_ids in meta.writes_done.items():
                for job_id in job_ids:
                    self.second_tiers[name].write_finished(job_id, ok=True)
            for name, job_ids in meta.writes_failed.items():
                for job_id in job_ids:
                    self.second_tiers[name].write_finished(job_id, ok=False)
        for rid in output.finished_sending or ():
            self.jobs.freed(rid)
            state = self._requests.get(rid)
            if state is not None and state.finished:
                del self._requests[rid]

    def _finish_load(self, rid: str, ok: bool) -> None:
        done = self.jobs.finish_load(rid, ok)
        if done is None:
            return
        if self.config.load_completion == "ordered":
            # Its copy may still be landing: the next step's forward is the first that can touch its blocks (the
            # request resumes, another request hits them, or they are freed and handed out again).
            self._load_fences.append(done.load.job.job_id)
        if done.live and ok:
            # Tokens the request really got from the tier (vLLM's external_prefix_cache_hits counted them when the
            # load was admitted, whatever became of it; a load of an aborted request serves nobody).
            self.stats.record_loaded_tokens(done.load.tokens)
        if ok:
            return
        self.counters.load_failures += 1
        state = self._requests.get(rid)
        if state is not None and not done.retired:
            # Recompute, never offer this request a load again. vLLM frees a failed load's blocks when it
            # promotes the request but leaves it in `_inflight_prefills`, so an async load offered to it now is
            # gated against its own full need on top of everyone else's: refused, the waiting loop breaks at the
            # head of `kv_holding_waiting`, and any load that landed behind it is never promoted (a stall; the
            # tier still serves the prefix when another load of it held the entries pinned). A recomputed
            # prefill is not gated that way and clears the stale entry when it is scheduled.
            state.no_load = True
            state.requeue = True
            state.gated_unscheduled = True
            # The admission moved store planning to the hit (window_scanned; nothing is planned while the load is in
            # flight), past the prefix whose entries the failure just dropped: the recompute stores it again from the
            # start, with a window at the hit as the stored one had (entries still in the tier are skipped).
            state.junctions.add(state.window_scanned)
            state.restart_stores()

    def _finish_store(self, job_id: int, ok: bool) -> None:
        rid = self.jobs.finish_store(job_id, ok)
        state = self._requests.get(rid) if rid is not None else None
        if state is not None:
            state.pending_stores.discard(job_id)
            if state.finished and not state.pending_stores:
                self._rank_for_eviction(state)

    def take_stats(self) -> OffloadStats | None:
        """This step's scheduler-side metrics (deferrals, tier usage, evictions), for `get_kv_connector_stats`."""
        # Called every step: only O(1) tier facts here (TierIndex.stats() walks every entry).
        bias = getattr(self.tier.policy, "bias", 0.0)
        self.stats.record_tier(self.tier.used_slots(), self.tier.capacity_slots, self.tier.evictions,
                               self.tier.store_rejections, bias if isinstance(bias, (int, float)) else 0.0)
        self.stats.record_deferred_requests(
            sum(1 for s in self._requests.values() if s.deferred_since is not None))
        for second in self.second_tiers.values():
            second.record_stats(self.stats)
        return self.stats.take()

    def has_pending_work(self) -> bool:
        # Also while events wait to be published (a reset on an idle engine) and before the first step.
        return (self.jobs.busy() or bool(self.events) or self._startup_step_pending
                or any(second.busy() for second in self.second_tiers.values()))

    # ------------------------------------------------------------------ operations
    def reset_cache(self) -> bool:
        """Empty the CPU tier: vLLM's `reset_cache()` hook (`POST /reset_prefix_cache?reset_external=true`, and the
        cache resets of pause / sleep / weight updates, all between steps).

        Idle entries are freed at once. Entries an in-flight job uses are retired (`TierIndex.clear`): a load in
        flight still reads its slots and lands normally (its request gets the KV it was admitted with), a store in
        flight still writes its slots but is never published; each job releases its slots when the worker reports
        it, so no slot is reused under a copy. Every lookup after the reset misses until new stores land. Requests
        still running store their blocks again from the start (their progress is reset), so the tier refills with
        what the GPU holds. Readable entries are announced removed (KV cache events). Always succeeds."""
        self.jobs.retire_in_flight()
        before = self.tier.used_slots()
        # The second tiers too: a reset (e.g. after a weight update) must not serve old KV from them either.
        for second in self.second_tiers.values():
            second.clear()
        self.tier.clear()
        for second in self.second_tiers.values():
            second.after_tier_clear()
        for state in self._requests.values():
            if not state.finished:
                state.restart_stores()
        self.resets += 1
        logger.info("offload_connector: CPU tier reset: %d slots freed, %d kept until %d in-flight copies finish",
                    before - self.tier.used_slots(), self.tier.used_slots(), self.jobs.num_retired())
        return True

    @property
    def events(self) -> TierEvents:
        return self._events

    @events.setter
    def events(self, events: TierEvents) -> None:
        # Tests turn events on after start-up; the job book and the store planner must see the same object.
        self._events = events
        self.jobs.events = events
        self.stores.events = events
        self.tier.on_removed = events.removed if events.enabled else None

    def take_events(self) -> list[KVCacheEvent]:
        """KV cache events (medium "CPU") since the last call: the connector's `take_events()`."""
        return self.events.take()

    # ------------------------------------------------------------ inspection
    def view(self) -> SchedulerView:
        """A read-only copy of the requests and jobs tracked now, for invariant checks (walks everything)."""
        return build_view(self._step, self._requests, self.jobs)

    def check(self) -> None:
        """Assert the job book's invariants against the requests tracked now (tests and simulations)."""
        self.jobs.check(self._requests)

    def record_admissions(self, maxlen: int = 4096) -> deque[Admission]:
        """Start keeping each admitted load with the pool around it (`admissions`), for tests that compare the
        ledger's prediction with vLLM's allocation. Off by default: it costs a pool query per admission."""
        if self.admission.log is None:
            self.admission.log = deque(maxlen=maxlen)
        return self.admission.log

    @property
    def admissions(self) -> deque[Admission] | None:
        """The admissions recorded since `record_admissions()`; None when not recording."""
        return self.admission.log


def skips_external_kv(request: Request) -> bool:
    """vLLM discards an external hit for these requests after asking (prompt logprobs, `skip_reading_prefix_cache`):
    vLLM 0.34's `skip_reading_external_kv`, 0.32/0.33's `skip_reading_prefix_cache`. Answering 0 keeps them out of
    deferrals and fairness holds for a load that would never happen."""
    return bool(getattr(request, "skip_reading_external_kv", False) or getattr(request, "skip_reading_prefix_cache",
                                                                              False))


def _fmt_bytes(n: int) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit} ({n} bytes)"
    return f"{n} bytes"
