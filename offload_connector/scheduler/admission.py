"""Admission of loads from the CPU tier: the lookup, the exact ledger's verdict, fairness between deferred loads, and
the load job issued once vLLM has allocated the request's blocks."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from offload_connector.config import OffloadConfig
from offload_connector.groups import cdiv
from offload_connector.keys import BlockKey
from offload_connector.log import get_logger
from offload_connector.metadata import TransferJob
from offload_connector.transfer_jobs import TierRead
from offload_connector.metrics import OffloadStatsSink
from offload_connector.scheduler import ledger
from offload_connector.scheduler.fairness import DeferredLoad, FairQueue
from offload_connector.scheduler.second_tier import SecondTierPlanner
from offload_connector.scheduler.jobs import JobBook
from offload_connector.scheduler.lookup import full_prefix_tokens, hit_upper, longest_hit
from offload_connector.scheduler.state import KVBinding, Layout, OfferedLoad, ReqState, SchedulerCounters
from offload_connector.scheduler.tier_index import TierIndex, in_prefix_order
from offload_connector.scheduler.watchdog import PoolHolder

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import Request

logger = get_logger(__name__)

# Where a loaded token came from when the CPU tier held it (vLLM's CacheHitSource value); a second tier's tokens
# go under its name ("disk", "shared").
HOST_SOURCE = "host"


@dataclass
class Admission:
    """A load we admitted, with what the pool looked like, so tests can compare prediction and allocation."""
    request_id: str
    step: int
    plan: ledger.LoadPlan
    free_before: int
    free_after: int | None = None
    entries_after: tuple[int, ...] = ()
    live_after: tuple[int, ...] = ()


class AdmissionControl:
    def __init__(self, config: OffloadConfig, layout: Layout, tier: TierIndex, requests: dict[str, ReqState],
                 jobs: JobBook, counters: SchedulerCounters, stats: OffloadStatsSink, fair: FairQueue) -> None:
        self.config = config
        self.layout = layout
        self.tier = tier
        self.requests = requests
        self.jobs = jobs
        self.counters = counters
        self.stats = stats
        self.fair = fair
        self.kv: KVBinding | None = None
        # Admissions with the pool around them, kept only while a test or simulation records them
        # (`OffloadScheduler.record_admissions`): in "vllm" reservation mode the plan is computed only for this log.
        self.log: deque[Admission] | None = None
        self._rows_cache: tuple[tuple[int, int, int], list[ledger.LedgerRow]] | None = None
        self._newer_cache: tuple[tuple[int, int, int, str], bool] | None = None
        # The second tiers, nearest first (the disk tier, then the shared store; `scheduler/second_tier.py`): lookups
        # extend into them, loads read their blocks back. Set by the scheduler side.
        self.second_tiers: tuple[SecondTierPlanner, ...] = ()
        # vLLM (0.32 to 0.34) caches a window in the GPU prefix cache at `request.shared_prefix_boundary` (unless its
        # `prefix_cache_retention_interval` is None); set by the scheduler side from the config.
        self.mark_junctions = False

    def bind(self, kv: KVBinding) -> None:
        self.kv = kv

    # ------------------------------------------------------------------ lookup
    def available(self, key: BlockKey) -> bool:
        """A key a load can copy from a tier of this host: a ready CPU-tier entry, or an entry of a local second tier
        (the disk tier) to read back first."""
        return self.tier.is_ready(key) or any(t.can_read(key) for t in self.second_tiers if t.local)

    def _ready_fn(self, request: Request, upper: int, step: int) -> Callable[[BlockKey], bool]:
        """The CPU tier's ready entries, extended by each second tier in turn with the blocks it holds (a remote one
        asks its store once per request and step for the blocks this lookup can use)."""
        ready: Callable[[BlockKey], bool] = self.tier.is_ready
        for second in self.second_tiers:
            ready = second.extend_ready(ready, request.request_id, self.layout.keys(request), self.layout.groups,
                                        self.layout.alignment, self.config.window_checkpoint_tokens, upper, step)
        return ready

    def hit(self, request: Request, upper: int, local: int = 0, step: int = 0) -> int:
        """The longest prefix up to `upper` tokens every group can restore from the tiers, past the `local` tokens
        vLLM already has (`_find`)."""
        return self._find(request, upper, local, step)[0]

    def _offer(self, request: Request, local: int, hit: int,
               blocks: list[tuple[int, int, BlockKey]] | None) -> OfferedLoad:
        """The load of tokens `local`..`hit`, its blocks listed here unless the lookup already did."""
        if blocks is None:
            blocks = self.load_keys(request, local, hit) if hit > local else []
        return OfferedLoad(local, hit, tuple(blocks))

    def _find(self, request: Request, upper: int, local: int,
              step: int) -> tuple[int, list[tuple[int, int, BlockKey]] | None]:
        """The hit, and the load's blocks when finding it listed them (the second-tier room check). Notes a
        shared-prefix end found there without its window, so that store planning keeps a window at it
        (`ReqState.junctions`).

        With a second tier (disk, shared), a hit that needs more CPU-tier slots for read-backs than the CPU tier can
        free now is cut back to what the CPU tier holds alone."""
        layout = self.layout
        keys = layout.keys(request)
        is_ready = self._ready_fn(request, upper, step)
        full = full_prefix_tokens(layout.groups, keys, is_ready, upper)
        hit = longest_hit(layout.groups, keys, is_ready, upper, layout.alignment, full_tokens=full)
        load = None
        if self.second_tiers and hit > local:
            load = self.load_keys(request, local, hit)
            # Room for every block of the load, not only the read-backs: its CPU-tier entries are pinned first and
            # may be the very entries has_room counts as evictable.
            if any(not self.tier.is_ready(key) for _, _, key in load) and not self.tier.has_room(len(load)):
                full = full_prefix_tokens(layout.groups, keys, self.tier.is_ready, upper)
                hit = longest_hit(layout.groups, keys, self.tier.is_ready, upper, layout.alignment, full_tokens=full)
                load = None
        # (a junction stays below the prompt's last token: vLLM's GPU prefix cache never hits the whole prompt)
        junction = min(full, request.num_tokens - 1)
        junction -= junction % layout.alignment
        state = self.requests.get(request.request_id)
        if state is not None and layout.has_recycling and state.window_scanned > max(hit, local):
            # Preempted past every point the tiers and vLLM can restore: what it computed since is lost, and the
            # windows it passed were handed over once (as spare ones, which a full tier skips) and are never offered
            # again, so each preemption would cost the same recompute. Keep the point it had reached as a junction
            # (a regular window) and plan its windows again, as after a failed load.
            state.junctions.add(state.window_scanned)
            state.restart_windows()
        if state is not None and state.unshared is None:
            # `full` is the whole prompt when no group is full attention: then only the hit and the GPU prefix tell.
            state.unshared = max(full if layout.has_full else 0, hit, local) == 0
        if junction > hit and state is not None and layout.has_full and layout.has_recycling:
            state.junctions.add(junction)
            # The recompute from `hit` then keeps the window at the junction on the GPU as well, so the next
            # request sharing this prefix resumes there from the GPU prefix cache. Never lower vLLM's own.
            if self.mark_junctions and junction > getattr(request, "shared_prefix_boundary", junction):
                request.shared_prefix_boundary = junction
        return hit, load

    def probe(self, request: Request) -> int:
        """The prefix this host's tiers (CPU, disk) could restore now, without any side effect: no shared-tier query,
        no junction noted, nothing touched. The shared tier's blocks are not probed (a network round trip)."""
        keys = self.layout.keys(request)
        upper = hit_upper(self.layout.groups, request.num_tokens, self.layout.alignment)
        full = full_prefix_tokens(self.layout.groups, keys, self.available, upper)
        return longest_hit(self.layout.groups, keys, self.available, upper, self.layout.alignment, full_tokens=full)

    def load_keys(self, request: Request, local: int, hit: int) -> list[tuple[int, int, BlockKey]]:
        """(group, block index, key) of every block a load of tokens `local`..`hit` copies: each group's blocks from
        the first one still in its window (or chunk) at `hit`, past what vLLM already has."""
        keys = self.layout.keys(request)
        out = []
        for g in self.layout.groups:
            start = max(local // g.block_size, g.first_live_block(hit))
            out.extend((g.index, i, keys(g.index, i)) for i in range(start, hit // g.block_size))
        return out

    def match(self, request: Request, state: ReqState, num_computed_tokens: int, step: int) -> tuple[int | None, bool]:
        """vLLM's `get_num_new_matched_tokens` for a request with no load in flight."""
        capped_since, state.admitted_step = state.admitted_step, None
        state.offer = None
        if state.requeue:
            # Its load failed. vLLM freed its blocks but left it in `kv_holding_waiting`, which is drained first and
            # breaks at the first request it cannot allocate: there, a recompute refused by the full-sequence gate
            # (`scheduler_reserve_full_isl`) holds back every load that landed behind it, whose blocks are what it
            # waits for (a stall). Skipped once, it is re-queued by whether it holds blocks: into `waiting`.
            state.requeue = False
            return None, False
        if state.no_load:  # recomputing its prefix; still behind any older deferred load
            held = self._held_for_older(request, num_computed_tokens, num_computed_tokens, step)
            return (None, False) if held else (0, False)
        self.counters.lookups += 1
        # Leave at least one prompt token to compute (the step that computes it produces the first output), or the
        # whole prompt where vLLM computes its last token again (`hit_upper`).
        upper = hit_upper(self.layout.groups, request.num_tokens, self.layout.alignment)
        hit, blocks = self._find(request, upper, num_computed_tokens, step)
        if hit - num_computed_tokens < self.config.min_load_tokens:
            state.deferred_since = None
            self.fair.clear(request.request_id)
            if self._held_for_older(request, num_computed_tokens, num_computed_tokens, step):
                return None, False
            return 0, False
        self.counters.hits += 1
        if not state.counted_hit:
            state.counted_hit = True
            self.counters.cpu_hit_tokens += hit - num_computed_tokens
        offer = self._offer(request, num_computed_tokens, hit, blocks)
        if self.config.reservation == "vllm":
            state.offered_hit, state.offer = hit, offer
            if self.log is not None:  # the comparison shows what the exact ledger would have seen
                plan = self.plan_load(request, hit, self._local_blocks(request, num_computed_tokens))
                self.log.append(Admission(request.request_id, step, plan, self._kv().pool.get_num_free_blocks()))
            return hit - num_computed_tokens, True
        return self._admit(request, state, offer, step, capped_since)

    def _admit(self, request: Request, state: ReqState, offer: OfferedLoad, step: int,
               capped_since: int | None = None) -> tuple[int | None, bool]:
        local, hit = offer.local, offer.hit
        kv = self._kv()
        local_blocks = self._local_blocks(request, local)
        plan = self.plan_load(request, hit, local_blocks)
        verdict = ledger.decide(plan, kv.pool.get_num_free_blocks(), kv.watermark,
                                self._reserved_by_others(request.request_id), self.layout.num_blocks - 1)
        if verdict is ledger.Verdict.ADMIT and self._held_for_older(request, local, hit, step, plan.total):
            self._keep_warm(offer)
            return None, False
        if verdict is ledger.Verdict.ADMIT:
            if capped_since is not None:
                # Admitted at the last lookup, never started: vLLM held it back (0.34 caps the loads in flight). It
                # waits as a deferred load waits, so it ages the same way and newer requests are held for it.
                if self._aged_out(request, state, local, hit, step, since=capped_since):
                    return 0, False
                self.counters.not_started += 1
                self._waits(request, offer, step, plan, "not_started")
            else:
                self.fair.clear(request.request_id)
                state.deferred_since = None
            state.admitted_step = state.load_step = step
            state.offered_hit, state.offer = hit, offer
            if self.log is not None:
                self.log.append(Admission(request.request_id, step, plan, kv.pool.get_num_free_blocks()))
            return hit - local, True
        if verdict is ledger.Verdict.DEFER:
            if self._aged_out(request, state, local, hit, step, since=step):
                return 0, False
            self.counters.deferrals += 1
            self._waits(request, offer, step, plan, "pool_full")
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

    def _waits(self, request: Request, offer: OfferedLoad, step: int, plan: ledger.LoadPlan, reason: str) -> None:
        """A load that waits this step (for room, or for vLLM to start it): counted under `reason`, its tier entries
        kept warm, and under fair admission newer requests held back for it."""
        self.stats.record_deferral(reason)
        self._keep_warm(offer)
        if self.config.admission_policy == "fair":
            self.fair.defer(request, step, sum(plan.now), plan.total, offer.hit // self.layout.hash_block_size)

    def _aged_out(self, request: Request, state: ReqState, local: int, hit: int, step: int, since: int) -> bool:
        """Start (at `since`) or continue the request's deferral clock; past `max_deferral_steps` give the load up:
        the request recomputes its prefix instead."""
        if state.deferred_since is None:
            state.deferred_since = since
        if step - state.deferred_since < self.config.max_deferral_steps:
            return False
        self.fair.clear(request.request_id)
        self.counters.deferral_timeouts += 1
        self.counters.aged_out_tokens += hit - local
        self.stats.record_deferral("aged_out")
        logger.warning("offload_connector: load of %d tokens for %s deferred %d steps; recomputing",
                       hit - local, request.request_id, step - state.deferred_since)
        state.no_load = True
        return True

    def _keep_warm(self, offer: OfferedLoad) -> None:
        """Touch the tier entries of a load that is waiting for room, every step it waits.

        It waits for exactly these blocks; left to age like any other entry, the stores of the requests that run
        meanwhile evict them, and the load shrinks or is lost before it gets its room. Measured on the decode-heavy
        replay (Gemma 4 31B, seed 2): returning sessions waited about 500 steps behind long decoders and their
        prefixes went from 9,952-11,968 tokens to the 1,024-token system prompt, so they were recomputed; touched,
        they are loaded whole (recompute 0.76x the patched vLLM's instead of 0.94x, TTFT p50 0.42x instead of 1.03x).
        """
        self.tier.touch([key for _, _, key in offer.blocks])

    def _held_for_older(self, request: Request, local: int, hit: int, step: int, need: int | None = None) -> bool:
        """Whether `request` must wait so that an older deferred load keeps the room it is waiting for.

        `need` is what the request would take through its prompt (computed here, only when it could matter, for a
        request without a load). It may go ahead only if the pool holds it, the older load's blocks, every holder's
        remaining need and the watermark. Before the older load has waited `fair_hold_after_steps`, that rule applies
        only while the load waits for requests behind it (`_waits_for_newer`): holding anyone back when it waits
        for older ones would slow them down and admit it no sooner. Called for every waiting request behind a
        deferred load on every step, so the pool's totals are computed once per step and pool state (a waiting
        request asked here holds no blocks)."""
        if self.config.admission_policy != "fair" or self.config.reservation != "exact":
            return False
        state = self.requests.get(request.request_id)
        if state is not None and state.gated_unscheduled:
            # vLLM reserves its prompt for every async load until it runs: holding it would hold the load too.
            return False
        if self._behind_a_load(request, local, hit, step):
            self.counters.held_behind_load += 1
            self.stats.record_deferral("behind_load")
            return True
        older = self.fair.oldest_ahead_of(request)
        if older is None or self.fair.shares_prefix(older, request):
            return False
        kv = self._kv()
        free = kv.pool.get_num_free_blocks()
        if not self.fair.holds_all(older, step) and not self._waits_for_newer(older, free, step):
            return False
        # Whatever this request takes through its prompt must leave what the older load's admission requires.
        room = free - ledger.required_free(older.now, older.total, self._holders_remaining(free, step), kv.watermark)
        if room > 0 and need is None:
            need = self.plan_load(request, hit, self._local_blocks(request, local)).total
        if need is not None and need <= room:
            return False
        self.counters.held_for_older += 1
        self.stats.record_deferral("held_for_older")
        return True

    def _behind_a_load(self, request: Request, local: int, hit: int, step: int) -> bool:
        """Whether `request` (`local` tokens in vLLM's GPU cache, a hit through `hit`) must wait for an older request's
        load in flight.

        vLLM schedules its running requests before its waiting ones. A newer request that starts a prefill longer than
        one step's budget while an older one's load is in flight is running when that load lands, and takes the
        budget before it every step until its prefill ends: a load of a few blocks cost its request the newer one's
        whole prefill (the layout sweep's rag-shared-docs at 64- and 128-token blocks, TTFT p95 1.02-1.04x the
        patched vLLM). Without a connector the older request would have gone first. A prefill that fits one step is
        not held: it ends before the load lands; nor is a request with a load of its own, which starts nothing before
        that load lands (held too, returning sessions waited longer for nothing: the sweep's 128-token window on
        gemma4-31b-returning went to TTFT p50 1.08x).

        The hold lasts at most a load's round trip: the step it was admitted and the batches in flight after it, when
        a load that lands in its own step is reported and its request can run. A load still in flight after that (a
        read-back from disk or the shared store, a slow copy, one held by a test) holds nobody: holding behind it
        would idle the queue for as long as that load takes. So it cannot stall, and it delays a newer request by a
        few steps at most."""
        if (not self.jobs.loads or not self.layout.step_tokens or hit > local
                or request.num_tokens - local <= self.layout.step_tokens):
            return False
        me = self.fair.order(request)
        for rid in self.jobs.loads:
            state = self.requests.get(rid)
            if (rid != request.request_id and state is not None and state.load_step is not None
                    and step - state.load_step <= self.layout.batches_in_flight
                    and self.fair.order(state.request) < me):
                return True
        return False

    def _waits_for_newer(self, load: DeferredLoad, free: int, step: int) -> bool:
        """Whether `load` would be admitted if every request behind it in vLLM's queue gave its blocks back: the
        blocks only they hold (shared prefix blocks stay), and their remaining need through their prompt."""
        key = (step, free, len(self.jobs.loads), load.request_id)
        if self._newer_cache is None or self._newer_cache[0] != key:
            released = reserved = 0
            for row in self._step_rows(free, step):
                state = self.requests[row.request_id]
                if self.fair.order(state.request) > load.order:
                    reserved += sum(row.remaining)
            for rid, state in self.requests.items():
                if not state.finished and self.fair.order(state.request) > load.order:
                    released += self._held_alone(rid)
            required = ledger.required_free(load.now, load.total,
                                            self._holders_remaining(free, step) - reserved, self._kv().watermark)
            self._newer_cache = (key, free + released >= required)
        return self._newer_cache[1]

    def _held_alone(self, request_id: str) -> int:
        """Blocks (all groups) held by this request and no other: what its end gives back to the free pool."""
        return sum(1 for m in self._kv().managers for blk in m.req_to_blocks.get(request_id, ())
                   if not blk.is_null and blk.ref_cnt == 1)

    def _step_rows(self, free: int, step: int) -> list[ledger.LedgerRow]:
        """The ledger rows, computed once per step and pool state for the fairness checks of every waiting request."""
        key = (step, free, len(self.jobs.loads))
        if self._rows_cache is None or self._rows_cache[0] != key:
            self._rows_cache = (key, self.rows())
        return self._rows_cache[1]

    def _holders_remaining(self, free: int, step: int) -> int:
        return sum(sum(r.remaining) for r in self._step_rows(free, step))

    def _local_blocks(self, request: Request, local: int) -> list[list[KVCacheBlock]]:
        """The local prefix-hit blocks vLLM adopts with a hit of `local` tokens.

        Looked up with vLLM's own bound (`num_tokens - 1`), not `local`: a chunked-local lookup bounded at `local`
        can stop at an evicted block inside the chunk and return fewer blocks than vLLM adopted. vLLM presents a
        block-aligned local hit and trims its blocks to it, so each group's list is cut to the hit."""
        if local == 0:
            return [[] for _ in self.layout.groups]
        blocks = self._kv().kv_manager.coordinator.find_longest_cache_hit(request.block_hashes,
                                                                          request.num_tokens - 1)[0]
        return [list(b)[: cdiv(local, g.block_size)] for g, b in zip(self.layout.groups, blocks)]

    def plan_load(self, request: Request, hit: int, local_blocks: list[list[KVCacheBlock]]) -> ledger.LoadPlan:
        """Exact per-group blocks a load of `hit` tokens takes now and may still take through its prompt."""
        target = self.layout.target_tokens(request)
        now, remaining, entries, live = [], [], [], []
        for g in self.layout.groups:
            taken, n_entries, n_live = ledger.load_blocks(g, hit, local_blocks[g.index])
            now.append(taken)
            entries.append(n_entries)
            live.append(n_live)
            remaining.append(ledger.remaining_blocks(g, target, n_entries, n_live, hit))
        return ledger.LoadPlan(hit, tuple(now), tuple(remaining), tuple(entries), tuple(live))

    # ------------------------------------------------------------------ ledger
    def rows(self, exclude: str | None = None) -> list[ledger.LedgerRow]:
        """One row per request that holds blocks (or that vLLM's gate still reserves for, `gated_unscheduled`) and
        has not finished its prompt: what it holds, what it may take."""
        managers = self._kv().managers
        rows = []
        for rid, state in self.requests.items():
            # Holding blocks means a non-empty block list: vLLM's Mamba manager leaves an empty one behind when it
            # only sized a request that then did not fit (`req_to_blocks` is a defaultdict), and a request that
            # holds nothing reserves nothing, unless vLLM's own gate still counts it.
            if rid == exclude or state.finished:
                continue
            if not state.gated_unscheduled and not any(m.req_to_blocks.get(rid) for m in managers):
                continue
            request = state.request
            if not _in_prefill(request):
                continue
            target = self.layout.target_tokens(request)
            # vLLM frees out-of-window blocks only up to the tokens whose batches have been processed.
            processed = max(0, request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0))
            held, remaining = [], []
            for g, manager in zip(self.layout.groups, managers):
                entries, live = ledger.live_counts(manager.req_to_blocks.get(rid, ()))
                held.append(live)
                remaining.append(ledger.remaining_blocks(g, target, entries, live, processed))
            rows.append(ledger.LedgerRow(rid, str(getattr(request.status, "name", request.status)), tuple(held),
                                         tuple(remaining), rid in self.jobs.loads))
        return rows

    def _reserved_by_others(self, request_id: str) -> int:
        return sum(sum(r.remaining) for r in self.rows(exclude=request_id))

    def snapshot(self, step: int) -> ledger.LedgerSnapshot:
        rows = self.rows()
        kv = self.kv
        return ledger.LedgerSnapshot(
            step=step,
            num_blocks=self.layout.num_blocks,
            free_blocks=kv.pool.get_num_free_blocks() if kv is not None else self.layout.num_blocks - 1,
            watermark_blocks=kv.watermark if kv is not None else 0,
            reserved_blocks=sum(sum(r.remaining) for r in rows),
            groups=ledger.summarize(rows, self.layout.groups),
            rows=tuple(rows),
            deferred=tuple(rid for rid, s in self.requests.items() if s.deferred_since is not None),
        )

    def holders(self) -> tuple[PoolHolder, ...]:
        """Every request holding GPU blocks, for a stall report."""
        managers = self._kv().managers
        holders = []
        for rid, state in self.requests.items():
            held = tuple(ledger.live_counts(m.req_to_blocks.get(rid, ()))[1] for m in managers)
            if any(held):
                status = getattr(state.request.status, "name", str(state.request.status))
                holders.append(PoolHolder(rid, status, held))
        return tuple(holders)

    # -------------------------------------------------------------------- load
    def start_load(self, request: Request, state: ReqState, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """vLLM allocated the blocks of an admitted load: pin its tier entries and issue the copy."""
        rid = request.request_id
        hit = state.offered_hit
        assert hit >= num_external_tokens, (rid, hit, num_external_tokens)
        block_ids = blocks.get_block_ids()
        log = self.log
        if log and log[-1].request_id == rid and log[-1].free_after is None:
            adm = log[-1]
            kv = self._kv()
            counts = [ledger.live_counts(m.req_to_blocks.get(rid, ())) for m in kv.managers]
            adm.free_after = kv.pool.get_num_free_blocks()
            adm.entries_after = tuple(c[0] for c in counts)
            adm.live_after = tuple(c[1] for c in counts)
        local = hit - num_external_tokens
        offer, state.offer = state.offer, None
        if offer is None or (offer.local, offer.hit) != (local, hit):
            # vLLM allocated for another load than the one offered at this step's lookup (not seen in 0.32-0.34):
            # issue what it allocated for.
            offer = OfferedLoad(local, hit, tuple(self.load_keys(request, local, hit)))
        groups_, gpu, keylist, load_ends, indices = [], [], [], [], []
        for gi, i, key in offer.blocks:
            groups_.append(gi)
            gpu.append(block_ids[gi][i])
            keylist.append(key)
            indices.append(i)
            load_ends.append((i + 1) * self.layout.groups[gi].block_size)
        groups_, gpu, keylist, indices = in_prefix_order(load_ends, groups_, gpu, keylist, indices)
        # Where each block comes from, before the load pins or promotes anything.
        sources = [self._source(key) for key in keylist]
        state.hit_sources = self._hit_sources(groups_, indices, sources, local, hit)
        self._issue(request, groups_, gpu, keylist, indices, sources, num_external_tokens)
        state.deferred_since = None
        state.admitted_step = None
        self.fair.clear(rid)
        state.stores_resume_at(hit, self.layout.groups)
        self.counters.loads_admitted += 1
        self.counters.loaded_tokens += num_external_tokens

    def _hit_sources(self, groups_: list[int], indices: list[int], sources: list[int], local: int,
                     hit: int) -> dict[str, int]:
        """The load's tokens `local`..`hit` split by the tier they come from (before the load pins or promotes
        anything): a token counts for the farthest tier among the loaded blocks that cover it; a token no loaded
        block covers (below every window of a layout without full attention) for the farthest tier of the load.
        Interval unions, not a walk over tokens: a million-token load has a few hundred thousand blocks."""
        names = (HOST_SOURCE, *(t.name for t in self.second_tiers))
        spans: list[list[tuple[int, int]]] = [[] for _ in names]  # per tier, nearest first: the token spans covered
        for gi, i, source in zip(groups_, indices, sources):
            bs = self.layout.groups[gi].block_size
            lo, hi = max(local, i * bs), min(hit, (i + 1) * bs)
            if lo < hi:
                # (a block no tier can read counts for the farthest: the lookup that found it saw it there)
                spans[min(source, len(names) - 1)].append((lo, hi))
        # Tokens whose farthest tier is at least r: the union of the spans of tiers r and beyond.
        at_least = [_covered([s for tier in spans[r:] for s in tier]) for r in range(len(names))] + [0]
        counts = [at_least[r] - at_least[r + 1] for r in range(len(names))]
        farthest = max((r for r in range(len(names)) if spans[r]), default=0)
        counts[farthest] += (hit - local) - at_least[0]
        return {name: n for name, n in zip(names, counts) if n}

    def _source(self, key: BlockKey) -> int:
        """0 for a ready CPU-tier entry, else 1 + the index of the nearest second tier that can read it back, and
        1 + the number of second tiers when none can."""
        if self.tier.is_ready(key):
            return 0
        return next((1 + r for r, t in enumerate(self.second_tiers) if t.can_read(key)), 1 + len(self.second_tiers))

    def _issue(self, request: Request, groups_: list[int], gpu: list[int], keylist: list[BlockKey], indices: list[int],
               sources: list[int], tokens: int) -> None:
        """Issue a load: its CPU-tier entries pinned, and those a second tier holds (disk, shared) given fresh
        CPU-tier entries (reserved like a store's, published when the load lands) that the worker reads them into
        first."""
        rid = request.request_id
        # Each key once, by where it comes from: the CPU tier, a second tier (nearest first), or none.
        by_source: list[list[BlockKey]] = [[] for _ in range(len(self.second_tiers) + 2)]
        for k, source in zip(keylist, sources):
            by_source[source].append(k)
        in_memory, by_tier, unreadable = by_source[0], by_source[1:-1], by_source[-1]
        slot_of = dict(zip(in_memory, self.tier.pin(in_memory)))
        self.tier.touch(in_memory)
        promoted = [k for keys in by_tier for k in keys] + unreadable
        reserved = self.tier.begin_store(promoted)
        slot_of.update(reserved)
        n_groups = len(self.layout.groups)
        if len(reserved) < len(promoted) or unreadable:
            # The lookup checked the room in this same scheduler call, so only a custom eviction policy that refuses
            # victims gets here: fail the load (vLLM recomputes the prefix) instead of copying a partial one.
            self.tier.finish_store([k for k, _ in reserved], ok=False)
            self.tier.unpin(in_memory)
            job = TransferJob.from_columns(self.jobs.new_job_id(), rid, n_groups, [], [], [],
                                           fail_reason="no CPU-tier slot free for a read-back")
            self.jobs.add_load(job, [], tokens)
            return
        # (each tier's finish hook, its read-back handle)
        after = [t.start_read(rid, keys) for t, keys in zip(self.second_tiers, by_tier) if keys]
        events = None
        if promoted and self.jobs.events.enabled:
            fresh = set(promoted)
            events = self.jobs.events.describe_store(
                request, [(g, i) for g, i, k in zip(groups_, indices, keylist) if k in fresh],
                self.layout.keys(request))
        job = TransferJob.from_columns(self.jobs.new_job_id(), rid, n_groups, groups_, gpu,
                                       [slot_of[k] for k in keylist],
                                       reads=tuple(TierRead(t.name, tuple(keys), tuple(slot_of[k] for k in keys))
                                                   for t, keys in zip(self.second_tiers, by_tier) if keys))
        self.jobs.add_load(job, keylist, tokens, promoted=promoted, read_back=after, events=events)

    def _kv(self) -> KVBinding:
        assert self.kv is not None, "bind_kv_cache_manager was not called"
        return self.kv


def _covered(spans: list[tuple[int, int]]) -> int:
    """Tokens in the union of half-open spans."""
    total, end = 0, None
    for lo, hi in sorted(spans):
        if end is None or lo > end:
            total += hi - lo
            end = hi
        elif hi > end:
            total += hi - end
            end = hi
    return total


def _in_prefill(request: Request) -> bool:
    # A load of the whole prompt counts the prompt computed until vLLM takes the landed load and steps back one
    # token; until then it is still in its prompt.
    if getattr(request.status, "name", None) == "WAITING_FOR_REMOTE_KVS":
        return True
    return request.num_computed_tokens < max(request.num_prompt_tokens, request.num_tokens - 1)

