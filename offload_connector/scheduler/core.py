"""Scheduler side of the connector: lookup, exact admission, load and store planning.

Lives in vLLM's scheduler process. It never imports CUDA and only hands plain `OffloadMetadata` to the workers.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Hashable

from offload_connector.config import OffloadConfig
from offload_connector.groups import GroupInfo, cdiv, check_against_manager, describe_groups, hit_alignment
from offload_connector.log import get_logger
from offload_connector.metadata import OffloadMetadata, OffloadWorkerMetadata, TransferJob
from offload_connector.metrics import OffloadStats, OffloadStatsSink
from offload_connector.scheduler import ledger
from offload_connector.scheduler.events import TierEvents, events_enabled
from offload_connector.scheduler.fairness import FairQueue
from offload_connector.scheduler.lookup import BlockKeys, full_prefix_tokens, longest_hit
from offload_connector.scheduler.tier_index import TierIndex
from offload_connector.scheduler.watchdog import PoolHolder, StallReport, StallWatchdog
from offload_connector.scheduler.windows import store_points

logger = get_logger(__name__)

@dataclass
class _LoadState:
    job: TransferJob
    keys: list[Hashable]
    tokens: int = 0  # the external tokens granted to vLLM for this load


@dataclass
class _ReqState:
    request: Any
    full_stored: list[int]  # per group: blocks [0, n) already handed to the tier (or found there)
    window_scanned: int = 0  # boundaries up to here were considered for window stores
    junctions: set[int] = field(default_factory=set)  # shared-prefix ends found at lookup without a window
    window_next: list[int] = field(default_factory=list)  # per group: window blocks below this were handed over
    deferred_since: int | None = None
    no_load: bool = False  # gave up loading (aged deferral); recompute instead
    pending_stores: set[int] = field(default_factory=set)
    finished: bool = False
    offered_hit: int = 0  # the hit (local + external) last offered to vLLM
    counted_hit: bool = False  # its CPU hit is in counters.cpu_hit_tokens


@dataclass
class _Admission:
    """A load we admitted, with what the pool looked like, so tests can compare prediction and allocation."""
    request_id: str
    step: int
    plan: ledger.LoadPlan
    free_before: int
    free_after: int | None = None
    entries_after: tuple[int, ...] = ()
    live_after: tuple[int, ...] = ()


@dataclass
class SchedulerCounters:
    lookups: int = 0
    hits: int = 0
    loads_admitted: int = 0
    loaded_tokens: int = 0
    deferrals: int = 0
    deferral_timeouts: int = 0
    held_for_older: int = 0  # steps a request waited behind an older deferred load (admission_policy "fair")
    cpu_hit_tokens: int = 0  # tokens the tier could serve, counted once per request at its first lookup with a hit
    aged_out_tokens: int = 0  # of those, tokens given up after max_deferral_steps and recomputed
    too_big_tokens: int = 0  # of those, tokens recomputed because the request could not fit an idle pool
    too_big: int = 0
    stores: int = 0
    stored_blocks: int = 0
    load_failures: int = 0


class OffloadScheduler:
    def __init__(self, config: OffloadConfig, vllm_config: Any, kv_cache_config: Any) -> None:
        self.config = config
        self.max_model_len = vllm_config.model_config.max_model_len
        spec_cfg = getattr(vllm_config, "speculative_config", None)
        self.num_spec_tokens = getattr(spec_cfg, "num_speculative_tokens", 0) or 0 if spec_cfg else 0
        self.num_lookahead_tokens = getattr(vllm_config, "num_lookahead_tokens", 0) or 0
        max_in_flight = _max_in_flight_tokens(vllm_config)
        self.groups: list[GroupInfo] = describe_groups(kv_cache_config, max_in_flight, self.num_lookahead_tokens)
        self.alignment = hit_alignment(self.groups)
        self.hash_block_size = getattr(kv_cache_config, "hash_block_size", None) or _gcd_block(self.groups)
        self.num_blocks = kv_cache_config.num_blocks
        pc = vllm_config.parallel_config
        self.reporters = max(1, pc.tensor_parallel_size * pc.pipeline_parallel_size)
        self.slot_bytes = max(g.block_bytes for g in self.groups)
        capacity = config.cpu_bytes // self.slot_bytes
        if capacity < 1:
            raise ValueError(
                f"kv_connector_extra_config: 'cpu_bytes' ({config.cpu_bytes}) is smaller than one host block "
                f"({self.slot_bytes} bytes for this model); give the CPU tier at least that much")
        self.tier = TierIndex(capacity, [g.block_bytes for g in self.groups], policy=config.eviction)
        self._has_full = any(not g.recycling for g in self.groups)
        self._has_recycling = any(g.recycling for g in self.groups)
        policy = getattr(getattr(vllm_config, "scheduler_config", None), "policy", "fcfs")
        self.fair = FairQueue(priority_policy=str(getattr(policy, "value", policy)) == "priority",
                              grace_steps=config.fair_hold_after_steps)
        self.counters = SchedulerCounters()
        self.stats = OffloadStatsSink()
        self.watchdog = StallWatchdog(config.stall_watchdog_steps)
        self._managers: list[Any] | None = None
        self._pool: Any = None
        self._kv_manager: Any = None
        self._watermark = 0
        self._requests: dict[str, _ReqState] = {}
        self._loads: dict[str, _LoadState] = {}  # admitted, copy in flight
        self._store_jobs: dict[int, tuple[str, list[Hashable], int]] = {}  # job -> (req, keys, reports seen)
        self._next_job = 0
        self._step = 0
        self._pending_loads: list[TransferJob] = []
        self._pending_stores: list[TransferJob] = []
        self._delayed_free: list[str] = []
        self._block_readers: dict[int, set[int]] = {}  # GPU block -> store jobs still reading it
        self._job_blocks: dict[int, tuple[int, ...]] = {}
        self._awaiting_free: set[str] = set()  # blocks kept alive for stores; vLLM frees on finished_sending
        # Loads whose request was aborted mid-copy: their tier entries stay pinned until the worker reports them.
        self._orphan_loads: dict[int, _LoadState] = {}
        self.admissions: deque[_Admission] = deque(maxlen=4096)
        self._holders_cache: tuple[tuple[int, int, int], int] | None = None
        # KV cache events for the tier (medium "CPU"), drained by take_events(); only when --kv-events-config
        # enables them. A store job's BlockStored events are built when it is planned, published when it lands.
        self.events = TierEvents(events_enabled(vllm_config), self.groups, kv_cache_config)
        self.tier.on_removed = self.events.removed if self.events.enabled else None
        self._store_events: dict[int, list[Any]] = {}
        # Jobs issued before the last reset_cache(): their tier entries are retired (see TierIndex.clear); when
        # they finish they release their slots instead of publishing or unpinning entries.
        self._retired_store_slots: dict[int, tuple[int, ...]] = {}
        self._retired_loads: set[int] = set()
        self.resets = 0
        # Until the first step, ask vLLM for one (has_pending_work): its stats carry the tier's capacity to
        # /metrics right after start-up instead of after the first request.
        self._startup_step_pending = True
        logger.info(
            "offload_connector scheduler side: CPU tier %s per worker = %d slots x %d bytes, shared by %d KV cache "
            "groups (one slot = one block of one group; %s); reservation %s, admission %s%s, eviction %s, "
            "window checkpoints every %d tokens, min load %d tokens, KV cache events %s",
            _fmt_bytes(config.cpu_bytes), capacity, self.slot_bytes, len(self.groups),
            "; ".join(f"group {g.index}: {g.kind.value}"
                      + (f" {g.sliding_window}" if g.sliding_window else "")
                      + (f" chunk {g.chunk_size}" if g.chunk_size else "")
                      + f", {g.num_layers} layers, {g.block_size}-token blocks of {g.block_bytes} bytes"
                      for g in self.groups),
            config.reservation, config.admission_policy,
            f" (holds newer requests after {config.fair_hold_after_steps} steps)"
            if config.admission_policy == "fair" else "",
            config.eviction, config.window_checkpoint_tokens, config.min_load_tokens,
            "on" if self.events.enabled else "off")

    # ------------------------------------------------------------------ binding
    def bind(self, kv_cache_manager: Any) -> None:
        coordinator = kv_cache_manager.coordinator
        self._managers = list(coordinator.single_type_managers)
        check_against_manager(self.groups, self._managers)
        self._pool = kv_cache_manager.block_pool
        self._kv_manager = kv_cache_manager
        self._watermark = int(getattr(kv_cache_manager, "watermark_blocks", 0) or 0)

    def on_new_request(self, request: Any) -> None:
        self._requests[request.request_id] = _ReqState(request, [0] * len(self.groups),
                                                       window_next=[0] * len(self.groups))

    # ------------------------------------------------------------------- lookup
    def _keys(self, request: Any) -> BlockKeys:
        return BlockKeys(request.block_hashes, self.hash_block_size, self.groups)

    def _hit(self, request: Any, upper: int) -> int:
        keys = self._keys(request)
        full = full_prefix_tokens(self.groups, keys, self.tier.is_ready, upper)
        hit = longest_hit(self.groups, keys, self.tier.is_ready, upper, self.alignment, full_tokens=full)
        junction = full - full % self.alignment
        state = self._requests.get(request.request_id)
        if junction > hit and state is not None and self._has_full and self._has_recycling:
            state.junctions.add(junction)
        return hit

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._requests.get(request.request_id)
        if state is None:  # a request we were not told about (should not happen); track it now
            self.on_new_request(request)
            state = self._requests[request.request_id]
        if request.request_id in self._loads:
            return 0, False
        if state.no_load:  # recomputing its prefix; still behind any older deferred load
            held = self._held_for_older(request, num_computed_tokens, num_computed_tokens)
            return (None, False) if held else (0, False)
        self.counters.lookups += 1
        # Leave at least one prompt token to compute: the step that computes it produces the first output.
        upper = request.num_tokens - 1
        hit = self._hit(request, upper)
        if hit - num_computed_tokens < self.config.min_load_tokens:
            state.deferred_since = None
            self.fair.clear(request.request_id)
            if self._held_for_older(request, num_computed_tokens, num_computed_tokens):
                return None, False
            return 0, False
        self.counters.hits += 1
        if not state.counted_hit:
            state.counted_hit = True
            self.counters.cpu_hit_tokens += hit - num_computed_tokens
        if self.config.reservation == "vllm":
            state.offered_hit = hit
            # Still computed and logged: the comparison shows what the exact ledger would have seen.
            plan = self.plan_load(request, hit, self._local_blocks(request, num_computed_tokens))
            self.admissions.append(_Admission(request.request_id, self._step, plan,
                                              self._pool.get_num_free_blocks()))
            return hit - num_computed_tokens, True
        return self._admit(request, state, num_computed_tokens, hit)

    def _admit(self, request: Any, state: _ReqState, local: int, hit: int) -> tuple[int | None, bool]:
        assert self._managers is not None, "bind_kv_cache_manager was not called"
        local_blocks = self._local_blocks(request, local)
        plan = self.plan_load(request, hit, local_blocks)
        verdict = ledger.decide(plan, self._pool.get_num_free_blocks(), self._watermark,
                                self._reserved_by_others(request.request_id), self.num_blocks - 1)
        if verdict is ledger.Verdict.ADMIT and self._held_for_older(request, local, hit, plan.total):
            return None, False
        if verdict is ledger.Verdict.ADMIT:
            self.fair.clear(request.request_id)
            state.deferred_since = None
            state.offered_hit = hit
            self.admissions.append(_Admission(request.request_id, self._step, plan, self._pool.get_num_free_blocks()))
            return hit - local, True
        if verdict is ledger.Verdict.DEFER:
            if state.deferred_since is None:
                state.deferred_since = self._step
            if self._step - state.deferred_since >= self.config.max_deferral_steps:
                self.fair.clear(request.request_id)
                self.counters.deferral_timeouts += 1
                self.counters.aged_out_tokens += hit - local
                self.stats.record_deferral("aged_out")
                logger.warning("offload_connector: load of %d tokens for %s deferred %d steps; recomputing",
                               hit - local, request.request_id, self._step - state.deferred_since)
                state.no_load = True
                return 0, False
            self.counters.deferrals += 1
            self.stats.record_deferral("pool_full")
            if self.config.admission_policy == "fair":
                self.fair.defer(request, self._step, sum(plan.now), plan.total)
            return None, False
        # TOO_BIG: the request's blocks through its prompt do not fit even an idle pool. A shorter hit would not
        # help: a load's total (now + remaining) is the request's need at its target minus the local blocks it
        # shares, whatever the hit length. Recompute: vLLM's chunked prefill recycles window blocks as it goes,
        # which a load admitted whole cannot.
        self.fair.clear(request.request_id)
        self.counters.too_big += 1
        self.counters.too_big_tokens += hit - local
        self.stats.record_deferral("too_big")
        state.no_load = True
        return 0, False

    def _held_for_older(self, request: Any, local: int, hit: int, need: int | None = None) -> bool:
        """Whether `request` must wait so that an older deferred load keeps the room it is waiting for.

        `need` is what the request would take through its prompt (computed here, only when it could matter, for a
        request without a load). It may go ahead only if the pool holds it, the older load's blocks, every holder's
        remaining need and the watermark. Called for every waiting request behind a deferred load on every step, so
        the holders' total is computed once per step and pool state (a waiting request asked here holds no blocks)."""
        if self.config.admission_policy != "fair" or self.config.reservation != "exact":
            return False
        older = self.fair.oldest_ahead_of(request, self._step)
        if older is None:
            return False
        free = self._pool.get_num_free_blocks()
        # Whatever this request takes through its prompt must leave what the older load's admission requires.
        room = free - ledger.required_free(older.now, older.total, self._holders_remaining(free), self._watermark)
        if room > 0 and need is None:
            need = self.plan_load(request, hit, self._local_blocks(request, local)).total
        if need is not None and need <= room:
            return False
        self.counters.held_for_older += 1
        self.stats.record_deferral("held_for_older")
        return True

    def _holders_remaining(self, free: int) -> int:
        key = (self._step, free, len(self._loads))
        if self._holders_cache is None or self._holders_cache[0] != key:
            self._holders_cache = (key, sum(sum(r.remaining) for r in self._rows()))
        return self._holders_cache[1]

    def _local_blocks(self, request: Any, local: int) -> list[list[Any]]:
        """The local prefix-hit blocks vLLM adopts with a hit of `local` tokens.

        Looked up with vLLM's own bound (`num_tokens - 1`), not `local`: a chunked-local lookup bounded at `local`
        can stop at an evicted block inside the chunk and return fewer blocks than vLLM adopted. vLLM presents a
        block-aligned local hit and trims its blocks to it, so each group's list is cut to the hit."""
        if local == 0:
            return [[] for _ in self.groups]
        blocks = self._kv_manager.coordinator.find_longest_cache_hit(request.block_hashes,
                                                                     request.num_tokens - 1)[0]
        return [list(b)[: cdiv(local, g.block_size)] for g, b in zip(self.groups, blocks)]

    def plan_load(self, request: Any, hit: int, local_blocks: list[list[Any]]) -> ledger.LoadPlan:
        """Exact per-group blocks a load of `hit` tokens takes now and may still take through its prompt."""
        target = self._target_tokens(request)
        now, remaining, entries, live = [], [], [], []
        for g in self.groups:
            taken, n_entries, n_live = ledger.load_blocks(g, hit, local_blocks[g.index])
            now.append(taken)
            entries.append(n_entries)
            live.append(n_live)
            remaining.append(ledger.remaining_blocks(g, target, n_entries, n_live, hit))
        return ledger.LoadPlan(hit, tuple(now), tuple(remaining), tuple(entries), tuple(live))

    def _target_tokens(self, request: Any) -> int:
        # The prompt, then one decode step (plus speculative and lookahead slots) so the request can run at all.
        return min(request.num_tokens + 1 + self.num_spec_tokens + self.num_lookahead_tokens, self.max_model_len)

    def _in_prefill(self, request: Any) -> bool:
        return request.num_computed_tokens < max(request.num_prompt_tokens, request.num_tokens - 1)

    def _rows(self, exclude: str | None = None) -> list[ledger.LedgerRow]:
        assert self._managers is not None
        rows = []
        first = self._managers[0].req_to_blocks
        for rid, state in self._requests.items():
            if rid == exclude or state.finished or rid not in first:
                continue
            request = state.request
            if not self._in_prefill(request):
                continue
            target = self._target_tokens(request)
            # vLLM frees out-of-window blocks only up to the tokens whose batches have been processed.
            processed = max(0, request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0))
            held, remaining = [], []
            for g, manager in zip(self.groups, self._managers):
                entries, live = ledger.live_counts(manager.req_to_blocks.get(rid, ()))
                held.append(live)
                remaining.append(ledger.remaining_blocks(g, target, entries, live, processed))
            rows.append(ledger.LedgerRow(rid, str(getattr(request.status, "name", request.status)), tuple(held),
                                         tuple(remaining), rid in self._loads))
        return rows

    def _reserved_by_others(self, request_id: str) -> int:
        return sum(sum(r.remaining) for r in self._rows(exclude=request_id))

    def snapshot(self) -> ledger.LedgerSnapshot:
        rows = self._rows()
        return ledger.LedgerSnapshot(
            step=self._step,
            num_blocks=self.num_blocks,
            free_blocks=self._pool.get_num_free_blocks() if self._pool is not None else self.num_blocks - 1,
            watermark_blocks=self._watermark,
            reserved_blocks=sum(sum(r.remaining) for r in rows),
            groups=ledger.summarize(rows, self.groups),
            rows=tuple(rows),
            deferred=tuple(rid for rid, s in self._requests.items() if s.deferred_since is not None),
        )

    # --------------------------------------------------------------- allocation
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        rid = request.request_id
        state = self._requests[rid]
        hit = state.offered_hit
        assert hit >= num_external_tokens, (rid, hit, num_external_tokens)
        block_ids = blocks.get_block_ids()
        if self.admissions and self.admissions[-1].request_id == rid and self.admissions[-1].free_after is None:
            adm = self.admissions[-1]
            assert self._managers is not None
            counts = [ledger.live_counts(m.req_to_blocks.get(rid, ())) for m in self._managers]
            adm.free_after = self._pool.get_num_free_blocks()
            adm.entries_after = tuple(c[0] for c in counts)
            adm.live_after = tuple(c[1] for c in counts)
        local = hit - num_external_tokens
        keys = self._keys(request)
        groups_, gpu, keylist, load_ends = [], [], [], []
        for g in self.groups:
            ids = block_ids[g.index]
            start = max(local // g.block_size, g.first_live_block(hit))
            for i in range(start, hit // g.block_size):
                key = keys(g.index, i)
                groups_.append(g.index)
                gpu.append(ids[i])
                keylist.append(key)
                load_ends.append((i + 1) * g.block_size)
        groups_, gpu, keylist = _in_prefix_order(load_ends, groups_, gpu, keylist)
        slots = self.tier.pin(keylist)
        self.tier.touch(keylist)
        job = TransferJob(self._new_job_id(), rid, tuple(groups_), tuple(gpu), tuple(slots))
        self._loads[rid] = _LoadState(job, keylist, num_external_tokens)
        self._pending_loads.append(job)
        state.deferred_since = None
        # Blocks below the hit are on the GPU once the load lands; store planning starts after them.
        state.full_stored = [hit // g.block_size if not g.recycling else 0 for g in self.groups]
        state.window_scanned = hit
        state.window_next = [hit // g.block_size for g in self.groups]
        self.counters.loads_admitted += 1
        self.counters.loaded_tokens += num_external_tokens

    def _new_job_id(self) -> int:
        self._next_job += 1
        return self._next_job

    # ------------------------------------------------------------------- stores
    def _plan_stores(self, state: _ReqState, computed: int, block_ids: list[list[int]] | None) -> None:
        """Hand newly computed blocks to the tier.

        Full-attention blocks are stored as they complete. A recycling group's blocks are stored only for the
        windows a later request can resume from (`windows.store_points`: the last full block before the prompt's
        end, the prompt's end and every boundary after it, checkpoints every `window_checkpoint_tokens` inside the
        prompt, and junctions where a lookup found a shared prefix without a window), never every window a long
        prefill passes through. Each window block is handed over once per request: a later point adds the blocks new
        since the last stored window and does not re-store older window blocks the tier has evicted meanwhile.
        (Re-storing them made every 32-token boundary copy a whole window once the tier was under pressure.) vLLM
        frees a window's oldest blocks as soon as the window moves, so a window is stored in the step that computes
        its point, and the end-of-request window cannot wait for `request_finished`.
        """
        request = state.request
        keys = self._keys(request)
        done = min(computed, keys.hashed_tokens())
        groups_, gpu, keylist, positions = [], [], [], []  # positions: token just past each block

        def ids_for(g: GroupInfo) -> list[int] | None:
            if block_ids is not None:
                return block_ids[g.index]
            assert self._managers is not None
            blocks = self._managers[g.index].req_to_blocks.get(request.request_id)
            return None if blocks is None else [0 if b.is_null else b.block_id for b in blocks]

        for g in self.groups:
            if g.recycling:
                continue
            ids = ids_for(g)
            if ids is None:
                continue
            end = min(done // g.block_size, len(ids))
            for i in range(state.full_stored[g.index], end):
                groups_.append(g.index)
                gpu.append(ids[i])
                keylist.append(keys(g.index, i))
                positions.append((i + 1) * g.block_size)
            state.full_stored[g.index] = max(state.full_stored[g.index], end)

        upto = done - done % self.alignment
        points = store_points(state.window_scanned, upto, request.num_prompt_tokens, self.alignment,
                              self.config.window_checkpoint_tokens, state.junctions) if self._has_recycling else []
        state.window_scanned = max(state.window_scanned, upto)
        for point in points:
            window: list[tuple[int, int, Hashable, int]] = []
            ends: list[tuple[int, int]] = []
            for g in self.groups:
                if not g.recycling:
                    continue
                ids = ids_for(g)
                rng = g.restore_range(point)
                new = range(max(rng.start, state.window_next[g.index]), rng.stop)
                if ids is None or len(ids) < rng.stop or any(ids[i] == 0 for i in new):
                    window = []  # part of this window already left the GPU: the point is not restorable
                    break
                window.extend((g.index, ids[i], keys(g.index, i), (i + 1) * g.block_size) for i in new)
                ends.append((g.index, rng.stop))
            else:
                for gi, stop in ends:
                    state.window_next[gi] = stop
            for gi, bid, key, end_token in window:
                groups_.append(gi)
                gpu.append(bid)
                keylist.append(key)
                positions.append(end_token)

        if not keylist:
            return
        groups_, gpu, keylist, ends = _in_prefix_order(positions, groups_, gpu, keylist, positions)
        reserved = dict(self.tier.begin_store(keylist))
        if not reserved:
            return
        sel = [i for i, k in enumerate(keylist) if k in reserved]
        job = TransferJob(self._new_job_id(), request.request_id, tuple(groups_[i] for i in sel),
                          tuple(gpu[i] for i in sel), tuple(reserved[keylist[i]] for i in sel))
        self._store_jobs[job.job_id] = (request.request_id, [keylist[i] for i in sel], 0)
        if self.events.enabled:
            self._store_events[job.job_id] = self.events.describe_store(
                request, [(groups_[i], ends[i] // self.groups[groups_[i]].block_size - 1) for i in sel], keys)
        self._job_blocks[job.job_id] = job.gpu_blocks
        for bid in job.gpu_blocks:
            self._block_readers.setdefault(bid, set()).add(job.job_id)
        state.pending_stores.add(job.job_id)
        self._pending_stores.append(job)
        self.counters.stores += 1
        self.counters.stored_blocks += job.num_blocks

    def request_finished(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        rid = request.request_id
        state = self._requests.get(rid)
        if state is None:
            return False, None
        state.finished = True
        self.fair.clear(rid)
        load = self._loads.pop(rid, None)
        if load is not None:
            # Aborted while its load was in flight: the copy still targets the request's blocks, which vLLM itself
            # keeps until the load reports in finished_recving (finish_requests, WAITING_FOR_REMOTE_KVS) and then
            # frees. The tier entries stay pinned until the worker reports the job (see update_connector_output).
            self._orphan_loads[load.job.job_id] = load
        if request.num_computed_tokens > 0 and load is None:
            self._plan_stores(state, request.num_computed_tokens, [list(ids) for ids in block_ids])
        # Delay the free only for stores that read the blocks vLLM is about to free. With a load in flight vLLM
        # already delays the free until finished_recving and frees the blocks then: a finished_sending for the same
        # request would free them a second time (vLLM asserts the request still exists). Any store pending then was
        # issued before a preemption, from blocks vLLM freed at the preemption; the fences cover those.
        if state.pending_stores and load is None:
            self._delayed_free.append(rid)
            self._awaiting_free.add(rid)
            return True, None
        del self._requests[rid]
        return False, None

    # ------------------------------------------------------------- step output
    def build_meta(self, scheduler_output: Any) -> OffloadMetadata:
        self._step += 1
        self._startup_step_pending = False
        # Fences look only at stores issued in earlier steps: this step's stores read after this step's forward.
        fences = self._fences(scheduler_output)
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            state = self._requests.get(rid)
            if state is None or rid in self._loads:
                continue
            self._plan_stores(state, state.request.num_computed_tokens + n, None)
        self._watch(scheduler_output)
        meta = OffloadMetadata(step=self._step, loads=tuple(self._pending_loads), stores=tuple(self._pending_stores),
                               delayed_free=tuple(self._delayed_free), store_fences=fences)
        self._pending_loads, self._pending_stores, self._delayed_free = [], [], []
        return meta

    def _watch(self, scheduler_output: Any) -> None:
        # With no token scheduled nothing runs, so every unfinished request is waiting.
        waiting = sum(1 for st in self._requests.values() if not st.finished)
        in_flight = bool(self._loads or self._orphan_loads or self._store_jobs or self._pending_loads)
        detected = self.watchdog.observe(scheduler_output.total_num_scheduled_tokens, waiting, in_flight)
        if detected:
            self.watchdog.report(StallReport(self._step, self.watchdog.idle_steps, waiting, self.snapshot(),
                                             self._holders()))
        self.stats.record_stall_state(self.watchdog.stalled, detected)

    def _holders(self) -> tuple[PoolHolder, ...]:
        assert self._managers is not None
        holders = []
        for rid, state in self._requests.items():
            held = tuple(ledger.live_counts(m.req_to_blocks.get(rid, ()))[1] for m in self._managers)
            if any(held):
                status = getattr(state.request.status, "name", str(state.request.status))
                holders.append(PoolHolder(rid, status, held))
        return tuple(holders)

    def _fences(self, scheduler_output: Any) -> tuple[int, ...]:
        """Store jobs still reading a block that this step allocates afresh (freed by a window move, reused)."""
        if not self._block_readers:
            return ()
        fences: set[int] = set()

        def scan(block_ids: Any) -> None:
            for ids in block_ids or ():
                for bid in ids:
                    readers = self._block_readers.get(bid)
                    if readers:
                        fences.update(readers)

        for new in scheduler_output.scheduled_new_reqs:
            scan(new.block_ids)
        for ids in scheduler_output.scheduled_cached_reqs.new_block_ids:
            scan(ids)
        return tuple(sorted(fences))

    def update_connector_output(self, output: Any) -> None:
        for rid in output.finished_recving or ():
            self._finish_load(rid, ok=rid not in (getattr(output, "failed_recving", None) or ()))
        meta = getattr(output, "kv_connector_worker_meta", None)
        if isinstance(meta, OffloadWorkerMetadata):
            for job_id in meta.stores_done:
                self._finish_store(job_id, ok=True)
            for job_id in meta.stores_failed:
                self._finish_store(job_id, ok=False)
        for rid in output.finished_sending or ():
            self._awaiting_free.discard(rid)
            state = self._requests.get(rid)
            if state is not None and state.finished:
                del self._requests[rid]

    def _finish_load(self, rid: str, ok: bool) -> None:
        load = self._loads.pop(rid, None)
        if load is not None and ok:
            # Tokens the request really got from the tier (vLLM's external_prefix_cache_hits counted them when the
            # load was admitted, whatever became of it; a load of an aborted request below serves nobody).
            self.stats.record_loaded_tokens(load.tokens)
        if load is None:
            for job_id, orphan in list(self._orphan_loads.items()):
                if orphan.job.request_id == rid:
                    load = self._orphan_loads.pop(job_id)
                    break
        if load is None:
            return
        if load.job.job_id in self._retired_loads:  # issued before a reset: its entries were retired
            self._retired_loads.discard(load.job.job_id)
            self.tier.release_retired(load.job.host_slots)
            if not ok:
                self.counters.load_failures += 1
            return
        self.tier.unpin(load.keys)
        if not ok:
            self.counters.load_failures += 1
            self.tier.drop(load.keys)
            state = self._requests.get(rid)
            if state is not None:
                # Recompute, never offer this request a load again. vLLM frees a failed load's blocks when it
                # promotes the request but leaves it in `_inflight_prefills`, so an async load offered to it now is
                # gated against its own full need on top of everyone else's: refused, the waiting loop breaks at the
                # head of `kv_holding_waiting`, and any load that landed behind it is never promoted (a stall; the
                # tier still serves the prefix when another load of it held the entries pinned). A recomputed
                # prefill is not gated that way and clears the stale entry when it is scheduled.
                state.no_load = True

    def _finish_store(self, job_id: int, ok: bool) -> None:
        entry = self._store_jobs.get(job_id)
        if entry is None:
            return
        rid, keys, seen = entry
        if ok and seen + 1 < self.reporters:
            self._store_jobs[job_id] = (rid, keys, seen + 1)
            return
        del self._store_jobs[job_id]
        for bid in self._job_blocks.pop(job_id, ()):
            readers = self._block_readers.get(bid)
            if readers is not None:
                readers.discard(job_id)
                if not readers:
                    del self._block_readers[bid]
        retired = self._retired_store_slots.pop(job_id, None)
        events = self._store_events.pop(job_id, None)
        if retired is not None:  # issued before a reset: its entries were retired, nothing is published
            self.tier.release_retired(retired)
        else:
            self.tier.finish_store(keys, ok=ok)
            if ok:
                self.events.stored(events)
        state = self._requests.get(rid)
        if state is not None:
            state.pending_stores.discard(job_id)

    def take_stats(self) -> OffloadStats | None:
        """This step's scheduler-side metrics (deferrals, tier usage, evictions), for `get_kv_connector_stats`."""
        # Called every step: only O(1) tier facts here (TierIndex.stats() walks every entry).
        self.stats.record_tier(self.tier.used_slots(), self.tier.capacity_slots, self.tier.evictions,
                               self.tier.store_rejections)
        self.stats.record_deferred_requests(
            sum(1 for s in self._requests.values() if s.deferred_since is not None))
        return self.stats.take()

    def has_pending_work(self) -> bool:
        # Also while events wait to be published (a reset on an idle engine) and before the first step.
        return bool(self._loads or self._store_jobs or self._pending_loads or self._pending_stores
                    or self._awaiting_free or self._orphan_loads or self.events or self._startup_step_pending)

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
        for job_id, (_rid, keys, _seen) in self._store_jobs.items():
            if job_id not in self._retired_store_slots:  # (retired by an earlier reset: its keys may be new entries)
                self._retired_store_slots[job_id] = tuple(self.tier.slot_of(k) for k in keys)
        self._store_events.clear()
        for load in (*self._loads.values(), *self._orphan_loads.values()):
            self._retired_loads.add(load.job.job_id)
        before = self.tier.used_slots()
        self.tier.clear()
        for state in self._requests.values():
            if not state.finished:
                state.full_stored = [0] * len(self.groups)
                state.window_next = [0] * len(self.groups)
                state.window_scanned = 0
        self.resets += 1
        logger.info("offload_connector: CPU tier reset: %d slots freed, %d kept until %d in-flight copies finish",
                    before - self.tier.used_slots(), self.tier.used_slots(),
                    len(self._retired_store_slots) + len(self._retired_loads))
        return True

    def take_events(self) -> list[Any]:
        """KV cache events (medium "CPU") since the last call: the connector's `take_events()`."""
        return self.events.take()



def _in_prefix_order(positions: list[int], *columns: list[Any]) -> list[list[Any]]:
    """Reorders parallel per-block lists by the token position just past each block, across groups.

    The tier ages a prefix from its tail in the order it is handed blocks, so in this order a window is evicted
    together with the full-attention blocks around its point, not before them (which left those full-attention
    blocks useless past the last window still stored)."""
    order = sorted(range(len(positions)), key=positions.__getitem__)
    return [[col[i] for i in order] for col in columns]


def _fmt_bytes(n: int) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit} ({n} bytes)"
    return f"{n} bytes"


def _gcd_block(groups: list[GroupInfo]) -> int:
    return math.gcd(*(g.block_size for g in groups))


def _max_in_flight_tokens(vllm_config: Any) -> int:
    value = getattr(vllm_config, "max_in_flight_tokens", None)
    if value is not None:
        return int(value)
    batches = getattr(vllm_config, "max_concurrent_batches", 1) or 1
    return batches * vllm_config.scheduler_config.max_num_batched_tokens
