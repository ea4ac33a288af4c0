"""Store planning: which newly computed blocks go to the CPU tier, and when."""

from __future__ import annotations

from typing import Hashable

from offload_connector.config import OffloadConfig
from offload_connector.groups import GroupInfo, GroupKind
from offload_connector.metadata import TransferJob
from offload_connector.scheduler.events import TierEvents
from offload_connector.scheduler.jobs import JobBook
from offload_connector.scheduler.lookup import hit_upper
from offload_connector.scheduler.state import KVBinding, Layout, ReqState, SchedulerCounters
from offload_connector.scheduler.tier_index import TierIndex, in_prefix_order
from offload_connector.scheduler.windows import spare_points, store_points


class StorePlanner:
    def __init__(self, config: OffloadConfig, layout: Layout, tier: TierIndex, jobs: JobBook, events: TierEvents,
                 counters: SchedulerCounters) -> None:
        self.config = config
        self.layout = layout
        self.tier = tier
        self.jobs = jobs
        self.events = events
        self.counters = counters
        self.kv: KVBinding | None = None
        # Only Mamba groups get prefill checkpoints: an attention-only layout skips the per-step check.
        self._mamba = tuple(g for g in layout.groups if g.kind is GroupKind.MAMBA)

    def bind(self, kv: KVBinding) -> None:
        self.kv = kv

    def write_through_promoted(self) -> None:
        """Readable spare entries that became regular (a load used them, a store point covers them) go to the second
        tiers now, as a landed store's entries do."""
        promoted = self.tier.take_promoted()
        if promoted and self.jobs.on_stored:
            job_id = self.jobs.new_job_id()
            for callback in self.jobs.on_stored:
                callback(promoted, job_id)

    def plan(self, state: ReqState, computed: int, block_ids: list[list[int]] | None) -> None:
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

        `block_ids`: the request's blocks per group when vLLM no longer maps them (`request_finished`); otherwise
        they are read from vLLM's managers.
        """
        layout = self.layout
        request = state.request
        keys = layout.keys(request)
        # A block is stored once its KV is final and it has a key: with vLLM 0.34's lookahead hashes (EAGLE/MTP) the
        # key of a block exists only once the tokens its drafter KV reads are known, which `hashed_tokens` follows.
        done = max(0, min(computed - layout.reprefillable_tokens, keys.hashed_tokens()))
        groups_, gpu, keylist, positions = [], [], [], []  # positions: token just past each block

        def ids_for(g: GroupInfo) -> list[int] | None:
            if block_ids is not None:
                return block_ids[g.index]
            assert self.kv is not None, "bind_kv_cache_manager was not called"
            blocks = self.kv.managers[g.index].req_to_blocks.get(request.request_id)
            return None if blocks is None else [0 if b.is_null else b.block_id for b in blocks]

        for g in layout.groups:
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

        # This step's chunk only: the blocks of a later step (or of the table after a preemption) are other blocks.
        checkpoint_cols = self._note_checkpoints(state) if block_ids is None and self._mamba else {}
        upto = done - done % layout.alignment
        after_sampling = False
        points: list[int] = []
        spare_pts: list[int] = []
        if layout.has_recycling:
            points = store_points(state.window_scanned, upto, request.num_prompt_tokens, layout.alignment,
                                  self.config.window_checkpoint_tokens, state.junctions,
                                  hit_upper(layout.groups, request.num_prompt_tokens, layout.alignment))
            if self.config.spare_windows:
                spare_pts = spare_points(state.window_scanned, upto, layout.alignment, points)
            if layout.state_behind_drafts and any(p > request.num_prompt_tokens for p in (*points, *spare_pts)):
                # Only prefill forwards (no drafts scheduled yet) write a boundary's state into its own block; past the
                # prompt a step with drafts leaves it in a speculative block, and vLLM copies the accepted one into
                # the boundary's block after sampling. Every point this plan reaches has had that copy by the end of
                # this step's sampling (a point is planned once its block's tokens are known: the step that computes
                # its last token copies it), so the store is issued after sampling, or not at all.
                if layout.decode_states_after_sampling:
                    after_sampling = True
                else:
                    points = [p for p in points if p <= request.num_prompt_tokens]
                    spare_pts = [p for p in spare_pts if p <= request.num_prompt_tokens]
        state.window_scanned = max(state.window_scanned, upto)
        regular = set(points)
        spare_keys: set[Hashable] = set()
        offered: set[Hashable] = set()
        for point in sorted((*points, *spare_pts)):
            point_spare = point not in regular
            window: list[tuple[int, int, Hashable, int, bool]] = []
            ends: list[tuple[int, int, bool]] = []
            for g in layout.groups:
                if not g.recycling:
                    continue
                # A chunk's windows nest (resuming anywhere in it needs its blocks from the chunk's start), so each
                # chunked-local block serves every later point of its chunk, as a full-attention block does: regular.
                is_spare = point_spare and g.kind is not GroupKind.CHUNKED
                ids = ids_for(g)
                rng = g.restore_range(point)
                # A point a rule asked for hands over what no earlier such point did, exactly as without spare
                # windows; the blocks of it that went out as spare are promoted by `begin_store`, not copied again.
                handed = state.window_next[g.index]
                if is_spare:
                    handed = max(handed, state.spare_next.get(g.index, 0))
                new = range(max(rng.start, handed), rng.stop)
                held = (None if ids is None or len(ids) < rng.stop
                        else [_state_block(state, checkpoint_cols, g.index, ids, i) for i in new])
                if held is None or 0 in held:
                    # Part of this window already left the GPU, or a Mamba block there holds another position's
                    # state: the point is not restorable.
                    window = []
                    break
                window.extend((g.index, bid, keys(g.index, i), (i + 1) * g.block_size, is_spare)
                              for i, bid in zip(new, held))
                ends.append((g.index, rng.stop, is_spare))
            else:
                for gi, stop, is_spare in ends:
                    if not is_spare:
                        state.window_next[gi] = stop
                    state.spare_next[gi] = max(state.spare_next.get(gi, 0), stop)
            for gi, bid, key, end_token, is_spare in window:
                if key in offered:  # already in this step's store, as spare: a regular point makes it regular
                    if not is_spare:
                        spare_keys.discard(key)
                    continue
                offered.add(key)
                groups_.append(gi)
                gpu.append(bid)
                keylist.append(key)
                positions.append(end_token)
                if is_spare:
                    spare_keys.add(key)

        if not keylist:
            return
        groups_, gpu, keylist, ends = in_prefix_order(positions, groups_, gpu, keylist, positions)
        reserved = dict(self.tier.begin_store(keylist, unshared=bool(state.unshared), spare=spare_keys))
        self.write_through_promoted()
        if not reserved:
            return
        sel = [i for i, k in enumerate(keylist) if k in reserved]
        job = TransferJob.from_columns(self.jobs.new_job_id(), request.request_id, len(layout.groups),
                                       [groups_[i] for i in sel], [gpu[i] for i in sel],
                                       [reserved[keylist[i]] for i in sel], after_sampling=after_sampling)
        events = None
        if self.events.enabled:
            events = self.events.describe_store(
                request, [(groups_[i], ends[i] // layout.groups[groups_[i]].block_size - 1) for i in sel], keys)
        self.jobs.add_store(job, [keylist[i] for i in sel], events)
        state.pending_stores.add(job.job_id)
        self.counters.stores += 1
        self.counters.stored_blocks += job.num_blocks

    def _note_checkpoints(self, state: ReqState) -> dict[tuple[int, int], int]:
        """Remember the Mamba blocks this step's chunk fills with another position's state; return, per (group,
        boundary index), the column whose checkpoint holds that boundary's state this step.

        A layer that exports prefill checkpoints (Mamba-2; gated DeltaNet on FlashInfer) writes, in a chunk vLLM
        gives a checkpoint, the state after vLLM's checkpoint position into the block at column `cdiv(end, b) - 2`,
        the block of boundary `(column + 1) * b`. The position is a multiple of the cache-hit alignment: with
        fine-grained hash hits it can lie past that boundary, and under EAGLE/MTP's block drop one hash block
        before it. vLLM re-keys the block at its position; stored under its column's key, a later load would
        resume from another position's state. The Mamba manager records the checkpoint of the chunk it allocated
        this step (`_checkpoints`, vLLM 0.32-0.34); this runs in that step, before the chunk's points are planned.
        """
        assert self.kv is not None, "bind_kv_cache_manager was not called"
        rid = state.request.request_id
        cols: dict[tuple[int, int], int] = {}
        for g in self._mamba:
            checkpoint = getattr(self.kv.managers[g.index], "_checkpoints", {}).get(rid)
            if checkpoint is None:
                continue
            position, col = checkpoint
            if position != (col + 1) * g.block_size:
                state.foreign_states.add((g.index, col))
                if position % g.block_size == 0:
                    # The state after `position` tokens is that boundary's own: vLLM keys the block there too.
                    cols[(g.index, position // g.block_size - 1)] = col
        return cols


def _state_block(state: ReqState, checkpoint_cols: dict[tuple[int, int], int], group: int, ids: list[int],
                 i: int) -> int:
    """The GPU block holding block `i`'s KV or, for a Mamba group, the state after `(i + 1) * b` tokens; 0 if none
    does: its own block when it is real and holds no other position's state, else this step's checkpoint block that
    holds it."""
    if ids[i] and (group, i) not in state.foreign_states:
        return ids[i]
    col = checkpoint_cols.get((group, i))
    return ids[col] if col is not None and col < len(ids) and ids[col] else 0
