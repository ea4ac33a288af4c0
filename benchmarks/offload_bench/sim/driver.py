"""Drive vLLM's real `Scheduler` on CPU with a simulated model and a simulated copy engine for our connector.

The model is simulated by handing the scheduler one sampled token per request whose prompt is done (token 7), plus,
under speculative decoding, a random number (0..scheduled) of its scheduled draft tokens accepted: vLLM rolls the
rejected ones back out of `num_computed_tokens`, as it does for a real engine. Drafts reach the scheduler as they do
from EngineCore: a synchronous engine hands them over with `update_draft_token_ids` after each step's output; under
async scheduling `AsyncScheduler` schedules placeholder drafts itself and the worker fills them in. Our connector's
worker side is the real one (`OffloadWorker` and its `TransferEngine`), fed each step's metadata as vLLM's model
runner feeds it, over a simulated copy backend that moves *tags* instead of KV bytes (`sim.tagcopy.TagCopier`):
every GPU block a step computes gets the tag (group, block hash) of the tokens it holds, stores copy tags to host
slots, loads copy them back, and when a load lands every block of the request's restore range must carry the tag of
its own tokens. That checks the load and store plans, and the worker, end to end without a GPU.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from offload_connector.groups import GroupKind, cdiv
from offload_bench.sim.drafts import DraftCounts, DraftSampler
from offload_bench.sim.vllm_compat import runner_output, waiting_count
from offload_bench.sim.tagcopy import TagCopier, build_worker


class LoadContentError(AssertionError):
    pass


@dataclass(frozen=True, eq=False)
class CopiedState:
    """The tag of a recurrent state vLLM copied into its boundary's block after sampling, named before the block's
    tokens are (the sampled ones are appended after the copy): it reads as that block's key of the request that
    computed it once the request has hashed the block."""
    keys: Any  # the writer's `BlockKeys`, over its growing list of block hashes
    group: int
    index: int

    def resolve(self) -> Any:
        try:
            return self.keys(self.group, self.index)
        except IndexError:
            return ("unhashed-state", self.group, self.index)

    def __eq__(self, other: object) -> bool:
        return self.resolve() == (other.resolve() if isinstance(other, CopiedState) else other)

    def __hash__(self) -> int:
        return hash(self.resolve())

    def __repr__(self) -> str:
        return f"CopiedState({self.resolve()!r})"


class ImpossibleBatchError(AssertionError):
    """The simulated engine led vLLM to schedule a batch no engine would: the simulation is wrong, not the connector."""


@dataclass
class StepRecord:
    step: int
    scheduled_tokens: int
    running: int
    waiting: int
    free_blocks: int
    transfers_in_flight: bool

    @property
    def idle_while_waiting(self) -> bool:
        """The stall signature: nothing scheduled, requests waiting, and nothing in flight that could change it."""
        return self.scheduled_tokens == 0 and self.waiting > 0 and not self.transfers_in_flight


@dataclass
class DriveResult:
    steps: int
    stalled: bool
    first_stall_step: int | None
    zero_token_steps_idle: int  # steps with 0 tokens while requests wait and nothing is in flight
    finished: set[str]
    history: list[StepRecord] = field(default_factory=list)


class SchedulerDriver(DraftCounts):
    """Steps a real vLLM scheduler. With `engine` (the simulated copy backend; None for other connectors) our
    connector's real worker side runs over it: `worker`."""

    def __init__(self, scheduler: Any, engine: TagCopier | None = None, check_loads: bool = True,
                 record: bool = False, batch_depth: int | None = None, spec_seed: int = 0,
                 peaks: Any = None, record_admissions: bool = True) -> None:
        self.sched = scheduler
        self.peaks = peaks  # a sim.peaks.PeakChecker: reservations against blocks held, around every schedule()
        cfg = scheduler.vllm_config
        if batch_depth is None:
            # EngineCore's batch queue holds max_concurrent_batches batches: 2 under async scheduling, the pipeline
            # depth under pipeline parallelism, 1 otherwise.
            batch_depth = getattr(cfg, "max_concurrent_batches", 1)
        self.batch_depth = max(1, batch_depth)
        pc = cfg.parallel_config
        self.reporters = max(1, pc.tensor_parallel_size * pc.pipeline_parallel_size)
        self._queue: deque[tuple[Any, list[str], list[list[int]], dict[str, Any]]] = deque()
        self.engine = engine
        self.check_loads = check_loads
        self.record = record
        self.step_no = 0
        self.finished: set[str] = set()
        self.history: list[StepRecord] = []
        conn = scheduler.get_kv_connector()
        self.side = getattr(conn, "scheduler_side", None)
        if self.side is not None and record_admissions:
            # Simulations compare each admission's ledger prediction with vLLM's allocation (`side.admissions`).
            self.side.record_admissions()
        self.worker = build_worker(engine, scheduler) if engine is not None and self.side is not None else None
        self.delayed_free: set[str] = set()  # finished requests whose finished_sending the worker has not reported
        # Speculative decoding: how many drafts the proposer offers and the target accepts is random (seeded).
        self.num_spec_tokens = int(getattr(scheduler, "num_spec_tokens", 0) or 0)
        self.drafts = DraftSampler(spec_seed)
        # Under async scheduling the scheduler schedules placeholder drafts itself (AsyncScheduler); a synchronous
        # engine feeds the proposer's drafts after each step (EngineCore.post_step).
        self.feeds_drafts = self.num_spec_tokens > 0 and not cfg.scheduler_config.async_scheduling
        self._tagged: dict[str, list[int]] = {}  # per request, per group: blocks [0, n) already tagged
        self._settled: dict[str, int] = {}  # per request: tokens whose KV applied batches have computed
        self._unlanded: dict[str, int] = {}  # reported loads whose copies had not landed: request -> hit
        # This step's recurrent states vLLM copies after sampling: (request, group, its blocks then, first position).
        self._state_copies: list[tuple[str, Any, tuple[int, ...], int]] = []

    # ------------------------------------------------------------------ helpers
    @property
    def pool(self) -> Any:
        return self.sched.kv_cache_manager.block_pool

    def managers(self) -> list[Any]:
        return list(self.sched.kv_cache_manager.coordinator.single_type_managers)

    def add(self, requests: Iterable[Any]) -> None:
        for r in requests:
            self.sched.add_request(r)

    def _write_computed_tags(self, out: Any) -> None:
        """What this step's forward writes. A Mamba group's state at a boundary a prefill chunk ends on goes into
        the boundary's block. In a step with drafts next to speculative state blocks, the forward writes the state
        after each row into the columns from the running state block on, and vLLM copies the state of each boundary
        the accepted tokens reach into that boundary's block after sampling (`_copy_accepted_states`)."""
        if self.engine is None or self.side is None:
            return
        spec = getattr(out, "scheduled_spec_decode_tokens", None) or {}
        for rid, n in out.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            after = req.num_computed_tokens  # schedule() already advanced it
            before = after - n
            keys = self.side.layout.keys(req)
            # A block whose KV was computed before its tokens were known (an accepted draft, or an async placeholder)
            # gets its hash only later: tag from the first block not yet tagged, not only from this step's start.
            marks = self._tagged.get(rid)
            if marks is None:  # blocks below the first scheduled token came from a prefix hit or a load
                marks = self._tagged[rid] = [before // g.block_size for g in self.side.groups]
            drafts = len(spec.get(rid, ()))
            for g, mgr in zip(self.side.groups, self.managers()):
                blocks = mgr.req_to_blocks.get(rid, [])
                last = min(min(after, keys.hashed_tokens()) // g.block_size, len(blocks))
                copied = g.kind is GroupKind.MAMBA and drafts > 0 and g.spec_blocks > 0
                direct = min(last, before // g.block_size) if copied else last
                for i in range(min(before // g.block_size, marks[g.index]), direct):
                    if not blocks[i].is_null:
                        self.engine.gpu[blocks[i].block_id] = keys(g.index, i)
                marks[g.index] = last
                if g.kind is GroupKind.MAMBA:
                    self._write_checkpoint_tag(rid, g, mgr, blocks, keys)
                if copied:
                    for j in range(drafts + 1):
                        i = (after - 1) // g.block_size + j
                        if i < len(blocks) and not blocks[i].is_null:
                            self.engine.gpu[blocks[i].block_id] = ("mamba-draft", g.index, rid, before + j + 1)
                    self._state_copies.append((rid, g, tuple(0 if b.is_null else b.block_id for b in blocks), before))
                    continue
                if g.kind is GroupKind.MAMBA and after % g.block_size and (after - 1) // g.block_size < len(blocks):
                    # The state after a chunk that ends inside a block is in that block until the request reaches
                    # the block's end: it is no block boundary's state, and no load may hand it out as one.
                    running = blocks[(after - 1) // g.block_size]
                    if not running.is_null:
                        self.engine.gpu[running.block_id] = ("mamba-partial", g.index, rid, after)

    def _write_checkpoint_tag(self, rid: str, g: Any, mgr: Any, blocks: list[Any], keys: Any) -> None:
        """A prefill chunk with an internal checkpoint (a layer that exports one, K = 1) writes the state after vLLM's
        checkpoint position into the block at column `cdiv(end, b) - 2`, whatever boundary that column stands for:
        the position is a multiple of the cache-hit alignment (the hash block under fine-grained hits, or one block
        before the end under EAGLE's block drop), not of the Mamba block. The manager records it for the chunk it
        allocated this step (`MambaManager._checkpoints`); the block holds that boundary's state only when the
        position is the column's end."""
        checkpoint = getattr(mgr, "_checkpoints", {}).get(rid)
        if checkpoint is None:
            return
        position, col = checkpoint
        if 0 <= col < len(blocks) and not blocks[col].is_null:
            # The state after a boundary's tokens is that boundary's state, whichever column holds it.
            boundary = position % g.block_size == 0 and position > 0
            self.engine.gpu[blocks[col].block_id] = (keys(g.index, position // g.block_size - 1) if boundary
                                                     else ("mamba-checkpoint", g.index, rid, position))

    def _copy_accepted_states(self, req_ids: list[str], sampled: list[list[int]]) -> None:
        """vLLM's state copy after sampling: for each boundary p with C < p <= C + a (C the position of the batch's
        first row, a the tokens it sampled, the bonus one included) the state after p tokens goes into block
        p / b - 1 of the request's table as the batch ran. Stores this step issued before sampling read the block
        as it was before."""
        copies, self._state_copies = self._state_copies, []
        if not copies:
            return
        got = dict(zip(req_ids, sampled))
        for rid, g, ids, first in copies:
            keys = self.side.layout.keys(self.sched.requests[rid])
            accepted = len(got.get(rid, ()))
            for p in range(first + 1, first + accepted + 1):
                i = p // g.block_size - 1
                if p % g.block_size == 0 and i < len(ids) and ids[i]:
                    self.engine.overwrite_after_reads(ids[i], CopiedState(keys, g.index, i))

    def _write_settled_tags(self, out: Any, reqs: dict[str, Any], live: set[str]) -> None:
        """Tag blocks whose KV an applied batch computed before their tokens were known.

        Under async scheduling a block's last positions can be computed (as placeholders or accepted drafts) before
        its tokens, and so its hash, exist; the request may finish without being scheduled again, and its stores
        read that block. Once the batch's output is applied the hash exists: tag every block the settled tokens
        cover. For a request vLLM still tracks that is computed minus still in flight (rejected drafts rolled
        back). A request that finished while this batch was in flight is skipped by vLLM, but the batch still ran
        its rows on the GPU, at the positions the worker corrected for earlier rejections: its first row (the last
        sampled token) is valid KV, its drafts are not. Freed blocks are not touched.
        """
        if self.engine is None or self.side is None:
            return
        managers = self.managers()
        spec = getattr(out, "scheduled_spec_decode_tokens", None) or {}
        for rid, req in reqs.items():
            marks = self._tagged.get(rid)
            if marks is None:
                continue
            if rid in live:
                settled = max(0, req.num_computed_tokens - getattr(req, "num_in_flight_tokens", 0))
            else:
                # Its rows past the first are drafts only as far as it had rows for them: near max_model_len vLLM
                # schedules fewer rows than the drafts it lists.
                n = out.num_scheduled_tokens[rid]
                settled = self._settled.get(rid, 0) + n - min(len(spec.get(rid, ())), max(n - 1, 0))
            self._settled[rid] = settled
            keys = self.side.layout.keys(req)
            for g, mgr in zip(self.side.groups, managers):
                blocks = mgr.req_to_blocks.get(rid, [])
                last = min(min(settled, keys.hashed_tokens()) // g.block_size, len(blocks))
                for i in range(marks[g.index], last):
                    if not blocks[i].is_null:
                        self.engine.gpu[blocks[i].block_id] = keys(g.index, i)
                marks[g.index] = max(marks[g.index], last)

    def _verify_loaded(self, rids: set[str], hits: dict[str, int] | None = None) -> None:
        """Check the restore range of each landed load (`hits`: the hit of a load checked later than its report)."""
        if not (self.check_loads and self.engine is not None and self.side is not None):
            return
        for rid in rids:
            req = self.sched.requests.get(rid)
            if req is None:
                continue
            hit = req.num_computed_tokens if hits is None else hits[rid]
            keys = self.side.layout.keys(req)
            for g, mgr in zip(self.side.groups, self.managers()):
                blocks = mgr.req_to_blocks.get(rid, [])
                for i in _must_hold(g, hit, req.num_tokens, rid):
                    tag = self.engine.gpu.get(blocks[i].block_id)
                    if tag != keys(g.index, i):
                        raise LoadContentError(
                            f"{rid}: group {g.index} block {i} (gpu {blocks[i].block_id}) holds {tag!r} after load")

    # --------------------------------------------------------------------- step
    def step(self) -> StepRecord:
        """One engine step. With `batch_depth` 2 (async scheduling, as EngineCore's batch queue runs it) the next
        batch is scheduled before the previous one's output is applied."""
        self.step_no += 1
        if self.peaks is not None and self.side is not None:
            self.peaks.before_schedule(self.sched, self.side)
        out = self.sched.schedule()
        if self.peaks is not None and self.side is not None:
            self.peaks.after_schedule(self.sched, self.side, self.step_no)
        if self.worker is not None and out.kv_connector_metadata is not None:
            # As the model runner: handle_preemptions (the fences), then start_load_kv (this step's stores, loads).
            meta = out.kv_connector_metadata
            self.engine.expect(meta, self.step_no)
            self.worker.fence(meta)
            self.worker.start(meta)
            self.engine.check_issued(sampled=False)
            self.delayed_free.update(meta.delayed_free)
        if self._unlanded:
            self._check_ordered_loads(out)
        if self.feeds_drafts:
            self._check_drafts_follow_a_token(out)
        self._write_computed_tags(out)
        req_ids, sampled = self.drafts.sample(self.sched, out)
        self._copy_accepted_states(req_ids, sampled)
        if self.worker is not None:
            self.worker.after_sampling()  # vLLM's wait_for_save, after sampling when drafts are on
            self.engine.check_issued()
        # Whether a transfer was in flight during this step (measured before this step's completions land). A load
        # whose completion vLLM was told about but has not processed (its queue scan broke before reaching it) is
        # not in flight, so a wedged scheduler reads as idle. Blocks of finished requests that wait only for their
        # store's hand-off come back on their own, so that counts as in flight.
        landed = getattr(self.sched, "finished_recving_kv_req_ids", set())
        conn = self.sched.get_kv_connector()
        in_flight = self._transfers_pending() or any(
            r.status.name == "WAITING_FOR_REMOTE_KVS" and r.request_id not in landed
            for r in self.sched.requests.values()) or (conn is not None and conn.has_pending_push_work())
        self._queue.append((out, req_ids, sampled, {rid: self.sched.requests[rid] for rid in req_ids}))
        in_flight = in_flight or len(self._queue) > 1  # an earlier batch was still executing during this one
        # A full queue waits for its oldest batch; an empty step has nothing to overlap, so everything lands.
        while self._queue and (len(self._queue) >= self.batch_depth or out.total_num_scheduled_tokens == 0):
            self._apply_oldest()
        rec = StepRecord(self.step_no, out.total_num_scheduled_tokens, len(self.sched.running),
                         waiting_count(self.sched),
                         self.pool.get_num_free_blocks(), in_flight)
        if self.record:
            self.history.append(rec)
        return rec

    def _check_drafts_follow_a_token(self, out: Any) -> None:
        """In a synchronous engine drafts come from a landed batch's sampled token, and vLLM clears them when it
        schedules them or preempts the request, so a batch with drafts starts at the request's last token, the one
        without KV. A batch of drafts with no real token before them is a simulation artifact whose KV no check can
        judge (it once read as a finished request's last block never computed)."""
        for rid, drafts in (getattr(out, "scheduled_spec_decode_tokens", None) or {}).items():
            req = self.sched.requests[rid]
            start = req.num_computed_tokens - out.num_scheduled_tokens[rid]
            if drafts and start != req.num_tokens - 1:
                raise ImpossibleBatchError(f"{rid}: step {self.step_no} scheduled {len(drafts)} drafts from position "
                                           f"{start} with {req.num_tokens} tokens: drafts follow the last token")

    def _check_ordered_loads(self, out: Any) -> None:
        """Loads reported before they landed: none may be read by this step's forward unless the worker ordered the
        forward after the copy, and each is checked once its tags are in place."""
        unsettled = self.engine.unsettled_loads()
        for rid in out.num_scheduled_tokens:
            op = unsettled.get(rid)
            if rid in self._unlanded and op is not None and not op.forward_ordered:
                raise LoadContentError(f"{rid}: scheduled in step {self.step_no} before its load was ordered before "
                                       f"the forward pass")
        copying = {j.request_id for j in self.engine.inflight_jobs("load")}
        landed = {rid for rid in self._unlanded if rid not in copying}
        if landed:
            self._verify_loaded(landed, {rid: self._unlanded.pop(rid) for rid in landed})

    def _apply_oldest(self) -> None:
        from vllm.v1.outputs import KVConnectorOutput

        out, req_ids, sampled, reqs = self._queue.popleft()
        kv_out = None
        recving: set[str] = set()
        failed: set[str] = set()
        if self.worker is not None:
            # The copies due by the end of this batch land; then what the model runner asks the connector for.
            self.engine.advance(self.step_no)
            sending, recving, failed = self.worker.transfer_results()
            wmeta = self.worker.worker_meta()
            if wmeta is not None and self.reporters > 1:
                # One simulated worker stands for every TP rank and PP stage: each would report its shard of the
                # same store jobs, and vLLM's aggregator concatenates the reports (the scheduler side waits for all
                # of them). finished_sending/recving need no copies: the aggregator reports those once all agree.
                # Every field (second-tier writes, abandoned and settled reads too) as vLLM's aggregator would
                # concatenate the workers' reports: the connector's own `aggregate`, once per other worker.
                one = wmeta
                for _ in range(self.reporters - 1):
                    wmeta = wmeta.aggregate(one)
            self.worker.take_stats()  # vLLM takes the worker's stats every step; nothing reads them here
            self.delayed_free -= sending
            # Sorted: vLLM frees the blocks of `finished_sending` in iteration order, and a set of str iterates in
            # an order that changes with PYTHONHASHSEED, which would make a run depend on the process's hash seed
            # (which of two requests finishing together loses its prefix-cache blocks first). vLLM only iterates
            # these, so an ordered list stands in for its set.
            kv_out = KVConnectorOutput(finished_sending=sorted(sending) or None,  # type: ignore[arg-type]
                                       finished_recving=sorted(recving) or None,  # type: ignore[arg-type]
                                       kv_connector_worker_meta=wmeta)
            if failed:
                kv_out.failed_recving = failed
        mro = runner_output(req_ids, sampled, kv_out)
        live = {rid for rid, req in reqs.items() if not req.is_finished()}
        engine_outputs = self.sched.update_from_output(out, mro)
        self._write_settled_tags(out, reqs, live)
        for eco in engine_outputs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self.finished.add(o.request_id)
        pending = {rid for queued in self._queue for rid in queued[1]}
        for rid, req in reqs.items():
            if req.is_finished() and rid not in pending:
                self._tagged.pop(rid, None)
                self._settled.pop(rid, None)
        ok = recving - failed
        if self.engine is not None and self.engine.inflight:
            # Reported before its copy landed (load_completion "ordered"): checked once the forward that reads it
            # has been ordered after it (`_check_ordered_loads`).
            copying = {j.request_id for j in self.engine.inflight_jobs("load")} & ok
            for rid in copying:
                req = self.sched.requests.get(rid)
                if req is not None:
                    self._unlanded[rid] = req.num_computed_tokens
            ok -= copying
        self._verify_loaded(ok)
        if self.feeds_drafts and req_ids:
            self._propose_drafts(req_ids, sampled)

    def _propose_drafts(self, req_ids: list[str], sampled: list[list[int]]) -> None:
        """What a synchronous EngineCore does after each step: hand the proposer's drafts to the scheduler.

        The n-gram proposer offers up to `num_speculative_tokens` drafts per request of the batch (none when it finds
        no match). It proposes from a request's sampled tokens, so a request whose batch sampled nothing (a prefill
        chunk short of the prompt's end) gets none. The scheduler ignores drafts only for a request whose latest
        scheduled chunk is short of the prompt's end: under pipeline parallelism the prompt's last chunk may already
        be scheduled when the batch before it lands, and drafts handed over then would be scheduled as rows with no
        real token before them, which no engine does. Every token is 7, like the simulated model's samples, so
        accepted drafts leave the same history a plain decode would.
        """
        from vllm.v1.outputs import DraftTokenIds

        k = self.num_spec_tokens
        # Drawn for every request either way, so the stream stays as it was: only runs where a request got drafts
        # with nothing sampled before them (pipeline parallelism) change.
        counts = [self.drafts.rng.choice((0, k, k, self.drafts.rng.randint(0, k))) for _ in req_ids]
        drafts = [[7] * n if got else [] for n, got in zip(counts, sampled)]
        self.sched.update_draft_token_ids(DraftTokenIds(req_ids=list(req_ids), draft_token_ids=drafts))

    def run(self, max_steps: int = 100_000, stall_steps: int = 50,
            until: Callable[["SchedulerDriver"], bool] | None = None) -> DriveResult:
        zero_run = 0
        zero_idle_total = 0
        first_stall = None
        while self.step_no < max_steps:
            if until is not None and until(self):
                break
            if until is None and not self.busy():
                break
            rec = self.step()
            if rec.idle_while_waiting:
                zero_run += 1
                zero_idle_total += 1
                if zero_run >= stall_steps:
                    first_stall = rec.step - stall_steps + 1
                    return DriveResult(self.step_no, True, first_stall, zero_idle_total, self.finished,
                                       self.history)
            else:
                zero_run = 0
        return DriveResult(self.step_no, False, None, zero_idle_total, self.finished, self.history)

    def busy(self) -> bool:
        """Whether stepping can still change anything: requests, transfers, or connector work not yet issued."""
        conn = self.sched.get_kv_connector()
        return bool(self._queue or self.sched.has_unfinished_requests() or self._transfers_pending()
                    or (conn is not None and conn.has_pending_push_work()))

    def _transfers_pending(self) -> bool:
        """Whether the worker has copies issued and not yet reported."""
        return self.worker is not None and self.worker.engine is not None and self.worker.engine.pending() > 0

    def idle_invariant(self) -> bool:
        return (not self.sched.has_unfinished_requests()
                and self.pool.get_num_free_blocks() == self.sched.kv_cache_config.num_blocks - 1)


def _must_hold(group: Any, hit: int, num_tokens: int, rid: str) -> range:
    """Blocks a request resuming after `hit` tokens reads in `group`. A hit of the whole prompt resumes one token
    earlier (vLLM computes the last token again), inside the last block: that block and the window before that token
    are read. For Mamba state this is stated here rather than taken from the connector's `restore_range`, so a
    connector that restored no state would fail the check: vLLM resumes from the state in block `hit / b - 1`, and
    only at a block boundary."""
    if group.kind is not GroupKind.MAMBA:
        resume = min(hit, num_tokens - 1)
        return range(group.first_live_block(resume), cdiv(resume, group.block_size))
    if hit % group.block_size:
        raise LoadContentError(f"{rid}: loaded {hit} tokens, not a boundary of Mamba group {group.index}'s "
                               f"{group.block_size}-token blocks")
    return range(hit // group.block_size - 1, hit // group.block_size)
