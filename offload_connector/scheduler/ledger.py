"""The reservation ledger: exact per-group block accounting for admitting asynchronous KV loads.

vLLM (0.32/0.33) admits a load against `_request_remaining_blocks`, which caps a recycling group's need and then
subtracts a block list padded with null blocks: for a long loaded prefix it reserves nothing for sliding-window
groups, loads are admitted until no loaded request can take its next chunk, and a loaded request waiting for a
chunk is never preempted. Here every quantity is counted from live blocks:

* now       - blocks the load takes from the free pool at admission (vLLM's own allocation rule, including local
              prefix-hit blocks that leave the free queue when touched);
* remaining - blocks the request may still take until its prompt is done and its first decode step has a slot:
              full attention `cdiv(T, b) - len(blocks)`; recycling groups `min(ceiling, cdiv(T, b) - first) - live`,
              counted from `first`, the first block still inside the window (or chunk) at the tokens the request has
              processed, because vLLM never allocates a block below it again; `ceiling` is the most real blocks a
              request can hold at once (`groups.live_ceiling`) and `live` counts the real (non-null) blocks held.

A load is admitted only if `now` fits in the free pool next to the remaining need of every request that already holds
blocks and has not finished its prompt, plus vLLM's watermark, and `now + remaining` fits the free pool on its own;
from then on its own `remaining` is part of that reservation for every later load. A load whose `now + remaining`
could not fit even an idle pool is never admitted.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Iterable, Sequence

from offload_connector.groups import GroupInfo, cdiv

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import KVCacheBlock


def peak_blocks(group: GroupInfo, target_tokens: int, processed_tokens: int) -> int:
    """The most real blocks a recycling group can hold for a request from now until it reaches `target_tokens`.

    Blocks below the window at `processed_tokens` are freed before the next allocation and never allocated again,
    so only the blocks from there to the target count, and never more than the group's ceiling. A Mamba group's
    speculative blocks sit past the state blocks and are held throughout."""
    span = cdiv(target_tokens, group.block_size) - group.first_live_block(processed_tokens)
    assert group.live_ceiling is not None, group
    k = group.spec_blocks
    return max(min(span, group.live_ceiling - k), 0) + k


def remaining_blocks(group: GroupInfo, target_tokens: int, num_entries: int, num_live: int,
                     processed_tokens: int) -> int:
    """Blocks a request holding `num_entries` block-table entries (`num_live` of them real), with
    `processed_tokens` tokens processed, may still take from the free pool through `target_tokens`.

    Real blocks held below the window come back before anything new is allocated, so subtracting every real block
    held is exact: the pool gives back the stale ones and then lends up to the peak."""
    if group.recycling:
        return max(peak_blocks(group, target_tokens, processed_tokens) - num_live, 0)
    return max(cdiv(target_tokens, group.block_size) - num_entries, 0)


def load_blocks(group: GroupInfo, hit_tokens: int, local_blocks: Sequence[KVCacheBlock]) -> tuple[int, int, int]:
    """What admitting a load of `hit_tokens` computed tokens (local hit included) does to this group.

    Returns (blocks taken from the free pool now, block-table entries afterwards, live blocks afterwards).
    Mirrors `get_num_blocks_to_allocate` for a first allocation: local hit blocks inside the window are touched
    (an evictable one leaves the free queue), the rest of the prefix is allocated fresh, skipped positions are null.
    """
    entries = cdiv(hit_tokens, group.block_size)
    skipped = group.skipped_tokens(hit_tokens) // group.block_size
    fresh = max(entries - max(skipped, len(local_blocks)), 0)
    touched_free = sum(1 for blk in local_blocks[skipped:] if not blk.is_null and blk.ref_cnt == 0)
    k = group.spec_blocks  # a Mamba group's first allocation appends its speculative blocks, a load's too
    return fresh + touched_free + k, entries + k, entries - skipped + k


def live_counts(blocks: Sequence[KVCacheBlock]) -> tuple[int, int]:
    return len(blocks), sum(1 for blk in blocks if not blk.is_null)


class Verdict(str, Enum):
    ADMIT = "admit"
    DEFER = "defer"  # does not fit now, but blocks held by others will come back
    TOO_BIG = "too_big"  # would not fit even in an idle pool


@dataclass(frozen=True)
class LoadPlan:
    hit_tokens: int
    now: tuple[int, ...]  # per group
    remaining: tuple[int, ...]  # per group, after the load
    entries: tuple[int, ...] = ()  # block-table entries per group after the load (null padding included)
    live: tuple[int, ...] = ()  # real blocks per group after the load

    @property
    def total(self) -> int:
        return sum(self.now) + sum(self.remaining)


@dataclass(frozen=True)
class LedgerRow:
    request_id: str
    status: str
    held: tuple[int, ...]  # live blocks per group
    remaining: tuple[int, ...]  # blocks per group still to take through the end of the prompt
    loading: bool  # an admitted load is still in flight


@dataclass(frozen=True)
class GroupRow:
    index: int
    kind: str
    held: int
    reserved: int


@dataclass(frozen=True)
class LedgerSnapshot:
    """What the ledger believed at one point: enough to explain any admission decision after the fact."""
    step: int
    num_blocks: int
    free_blocks: int  # vLLM's free count (includes evictable cached blocks)
    watermark_blocks: int
    reserved_blocks: int  # sum of remaining over rows
    groups: tuple[GroupRow, ...]
    rows: tuple[LedgerRow, ...]
    deferred: tuple[str, ...]

    @property
    def headroom(self) -> int:
        return self.free_blocks - self.watermark_blocks - self.reserved_blocks


def decide(plan: LoadPlan, free_blocks: int, watermark_blocks: int, reserved_by_others: int,
           usable_blocks: int) -> Verdict:
    """Admission rule. `usable_blocks` is the pool without the null block.

    Two conditions, the same two vLLM's fixed gate applies (a full-sequence check, then the allocation against the
    other in-flight prefills' reservations):

    * the load's own blocks fit now next to what every other block holder still in its prompt may take; its own
      remaining need joins that reservation once it is admitted (it is a holder then), so every later load leaves
      room for it. This is what makes a stall impossible: every request that holds blocks without being able to run
      (an in-flight or landed load) can still take everything it needs through its prompt, and anything else that
      holds blocks is running and finishes or is preempted;
    * its whole need through the prompt fits the free pool now, so that it does not start a prefill the running
      requests would then have to be preempted for.

    Requiring both at once (`total + others`) made loads wait for blocks they take chunk by chunk while other
    prefills finish."""
    if plan.total + watermark_blocks > usable_blocks:
        return Verdict.TOO_BIG
    if required_free(sum(plan.now), plan.total, reserved_by_others, watermark_blocks) <= free_blocks:
        return Verdict.ADMIT
    return Verdict.DEFER


def required_free(now: int, total: int, reserved_by_others: int, watermark_blocks: int) -> int:
    """Free blocks a load taking `now` blocks (`total` through its prompt) needs to be admitted (see `decide`)."""
    return max(total, now + reserved_by_others) + watermark_blocks


def summarize(rows: Iterable[LedgerRow], groups: Sequence[GroupInfo]) -> tuple[GroupRow, ...]:
    held = [0] * len(groups)
    reserved = [0] * len(groups)
    for row in rows:
        for i in range(len(groups)):
            held[i] += row.held[i]
            reserved[i] += row.remaining[i]
    return tuple(GroupRow(g.index, g.kind.value, held[g.index], reserved[g.index]) for g in groups)
