"""The order a finished request's tier entries should be evicted in: by resume point, the last point first.

Stores hand a prompt over chunk by chunk in prefix order, so in the order entries became evictable a prompt's head is
its oldest part, and the first eviction takes the head: every block left is then useless (a hit needs the prefix
from its first token). Ranking the blocks by token position instead (tail first) is not right either where a group
keeps only a window: a resume point's windows are the very tail of the tokens before it, and without them the
full-attention blocks before the point cannot be resumed there.

What a later request can use is a *resume point* p: every full-attention block up to p and every block each
recycling group needs at p (`GroupInfo.restore_range`). Everything the request holds in the tier belongs to the
first point that needs it, and the points are given up from the last: first whatever no point needs (full-attention
blocks past the last point, windows of no point), then the last point's windows, then the full-attention blocks
between the previous point and it, and so on, so that what stays is always a shorter prefix that still loads.

Spare windows (`windows.py`) are not resume points here: they go before every regular entry anyway. A finished
request's spare entries are renewed, tail first, as the newest spare ones: they are the windows a request branching
inside this prompt resumes from, and without the renewal a long prompt's early spare windows were the oldest in the
tier by the time it finished (measured: rag-shared-docs on a 4,096-token window at 64-token blocks recomputed 51,200
tokens with the regular entries ranked alone, 45,056 with the spare ones renewed too).
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Callable, Hashable, Sequence

from offload_connector.groups import GroupInfo
from offload_connector.scheduler.lookup import BlockKeys


def resume_points(groups: Sequence[GroupInfo], keys: BlockKeys, held: Callable[[Hashable], bool],
                  alignment: int) -> list[int]:
    """Every multiple of `alignment` at which each group holds what a request resuming there needs, ascending."""
    return _points(groups, [list(map(held, keys.of_group(g.index))) for g in groups], keys.hashed_tokens(), alignment)


def eviction_order(groups: Sequence[GroupInfo], keys: BlockKeys, held: Callable[[Hashable], bool],
                   alignment: int) -> list[Hashable]:
    """The held keys of one request, first to evict first (see the module docstring)."""
    group_keys = [keys.of_group(g.index) for g in groups]
    flags = [list(map(held, ks)) for ks in group_keys]
    points = _points(groups, flags, keys.hashed_tokens(), alignment)
    beyond = len(points)  # the unit of blocks no point needs
    ranked: list[tuple[int, int, int, Hashable]] = []
    for g, ks, fl in zip(groups, group_keys, flags):
        recycling, size = g.recycling, g.block_size
        starts = [g.first_live_block(p) for p in points] if recycling else []
        for i, key in enumerate(ks):
            if not fl[i]:
                continue
            end = (i + 1) * size
            unit = bisect_left(points, end)
            # A window block belongs to the first point whose restore range holds it (ranges start later as points
            # move on, so no later point holds it either when that one does not).
            if recycling and unit < beyond and starts[unit] > i:
                unit = beyond
            # Last unit first; inside a unit the windows before the full-attention blocks, each tail first.
            ranked.append((-unit, 0 if recycling else 1, -end, key))
    ranked.sort(key=lambda r: r[:3])
    return [r[3] for r in ranked]


def spare_order(groups: Sequence[GroupInfo], keys: BlockKeys, spare: Callable[[Hashable], bool]) -> list[Hashable]:
    """The request's spare entries, tail first (first to evict first): a spare window serves only while the prefix
    before it stays, and the regular entries go from the tail."""
    ranked = [(-(i + 1) * g.block_size, key) for g in groups for i, key in enumerate(keys.of_group(g.index))
              if spare(key)]
    ranked.sort(key=lambda r: r[0])
    return [key for _, key in ranked]


def _points(groups: Sequence[GroupInfo], flags: list[list[bool]], hashed_tokens: int, alignment: int) -> list[int]:
    full = hashed_tokens
    for g, fl in zip(groups, flags):
        if not g.recycling:
            n = fl.index(False) if False in fl else len(fl)
            full = min(full, n * g.block_size)
    # Per recycling group, the length of the run of held blocks ending at each block: a point is restorable when the
    # run ending at its range's last block covers the whole range.
    runs: list[tuple[GroupInfo, list[int]]] = []
    for g, fl in zip(groups, flags):
        if g.recycling:
            run, length = [], 0
            for h in fl[:full // g.block_size]:
                length = length + 1 if h else 0
                run.append(length)
            runs.append((g, run))
    points = []
    for p in range(alignment, full - full % alignment + 1, alignment):
        for g, run in runs:
            last = p // g.block_size - 1
            if run[last] == 0 and g.first_live_block(p) <= last:  # most boundaries: the range's last block is missing
                break
            needed = g.restore_range(p)
            if len(needed) and run[needed[-1]] < len(needed):
                break
        else:
            points.append(p)
    return points
