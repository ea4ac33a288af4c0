"""Where a request's sliding-window and chunked-local blocks are worth storing: the points a later request resumes at.

A recycling group can restore a request only at a boundary whose whole window (or chunk) is in the tier, and a
window costs as much host memory as `window` tokens of that group. Storing every window a prefill passes through
costs every block; storing only where prompts end makes a prefix that another request shares up to a point inside
the prompt useless (its full-attention blocks are there, its window is not). The points kept:

* where a prompt sent again resumes (`lookup.hit_upper`): its end where vLLM takes a hit of the whole prompt and
  computes the last token again, else the last boundary before its last token (a block earlier for a prompt that
  ends on a boundary);
* the prompt's last boundary and, from there on, the latest boundary: the next turn resumes after the answer;
* every `spacing` tokens inside the prompt (checkpoints): shared system prompts, tool prefixes and documents end
  anywhere, a checkpoint at most `spacing` tokens before. The spacing follows from the layout
  (`checkpoint_spacing`): a checkpoint stores one window of every sliding group, so checkpoints every S tokens cost
  that window's tier slots per S tokens; S is the smallest multiple of the hit alignment at which that is no more
  than the full-attention KV of those S tokens. The tier slots per cached token then stay within twice the
  full-attention ones (vLLM's connector stores every group's every block) on any window, block size or group mix:
  window 128 at 1:1 layers gives every 128 tokens, Gemma 4 31B's five 1,024-token groups 10,240;
* junctions: a boundary where a lookup found an earlier request's full-attention blocks but no window (the two
  requests share the prefix to there); the request computing through it stores the window so a third one can
  resume exactly there.

Every other boundary's window is stored as a *spare* (`spare_windows`, on by default): in CPU-tier room no regular
entry uses, evicted before anything else (`tier_index.py`). A tier with room then resumes any prefix at its last
block boundary, whatever the window, the block sizes or where the traffic shares prefixes; a tier under pressure
keeps the points above. Chunked-local groups are stored regular at those boundaries instead (`stores.py`): a chunk's
windows nest, so each of its blocks serves every later point of the chunk, as a full-attention block does.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Iterable, Sequence

from offload_connector.groups import GroupInfo, GroupKind

# Far enough into a prompt that every sliding window is whole (its block count no longer depends on the position).
_DEEP = 1 << 30


def store_points(scanned: int, upto: int, prompt_tokens: int, alignment: int, spacing: int,
                 junctions: Iterable[int] = (), resend_upper: int | None = None) -> list[int]:
    """Boundaries in (scanned, upto], ascending, whose windows are stored. `upto` is a multiple of `alignment`;
    `resend_upper`: the most a hit of the same prompt may cover (`lookup.hit_upper`; one token short if not given)."""
    if upto <= scanned:
        return []
    points: set[int] = set()
    tail = (prompt_tokens - 1 if resend_upper is None else resend_upper) // alignment * alignment
    end = prompt_tokens // alignment * alignment
    points.update(p for p in (tail, end) if scanned < p <= upto)
    if upto >= tail:
        points.add(upto)
    if spacing > 0:
        step = max(spacing - spacing % alignment, alignment)
        points.update(range((scanned // step + 1) * step, upto + 1, step))
    points.update(j for j in junctions if scanned < j <= upto)
    return sorted(p for p in points if p > 0)


def spare_points(scanned: int, upto: int, alignment: int, kept: Iterable[int]) -> list[int]:
    """Every boundary in (scanned, upto] that `store_points` did not keep, ascending."""
    kept = set(kept)
    first = (scanned // alignment + 1) * alignment
    return [p for p in range(first, upto + 1, alignment) if p not in kept]


def checkpoint_spacing(groups: Sequence[GroupInfo], alignment: int) -> int:
    """Tokens between checkpoints for a layout: the smallest multiple of `alignment` at which one checkpoint's
    sliding windows (every sliding group's blocks a request resuming there needs) take no more CPU-tier slots than
    the full-attention blocks of the tokens since the previous checkpoint. 0 when no group has a sliding window
    (chunked-local blocks are kept at every boundary: `stores.py`); `alignment` when no group keeps every block.

    Counted in slots, not block bytes: every block takes one slot of the largest group's block size
    (`groups.tier_slots`), so a small block (DeepSeek-V4's 4- and 8-token compressor states) costs a whole slot. In
    block bytes the windows of a DeepSeek-V4 checkpoint looked 1.4x cheaper than they are, and the tier filled with
    them (the layout sweep's mooncake-synthetic case). Where every group's block has the same bytes the two agree."""
    window_slots = sum(len(g.restore_range(_DEEP - _DEEP % g.block_size))
                       for g in groups if g.recycling and g.kind is not GroupKind.CHUNKED)
    if window_slots == 0:
        return 0
    full_slots_per_token = sum((Fraction(1, g.block_size) for g in groups if not g.recycling), Fraction(0))
    if full_slots_per_token <= 0:
        return alignment
    tokens = math.ceil(window_slots / full_slots_per_token)
    return max(alignment, -(-tokens // alignment) * alignment)
