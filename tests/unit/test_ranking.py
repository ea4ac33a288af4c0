"""The eviction order of a finished request's tier entries (`scheduler/ranking.py`): given up by resume point."""

from __future__ import annotations

import random

import pytest

from offload_connector.groups import GroupInfo, GroupKind
from offload_connector.scheduler.lookup import BlockKeys, longest_hit
from offload_connector.scheduler.ranking import eviction_order, resume_points, spare_order


def group(i, kind, bs, window=0, chunk=0):
    return GroupInfo(index=i, kind=kind, block_size=bs, block_bytes=1, num_layers=1, sliding_window=window,
                     chunk_size=chunk, live_ceiling=100)


FULL16 = group(0, GroupKind.FULL, 16)
LAYOUTS = {
    "window 64": [FULL16, group(1, GroupKind.SLIDING, 16, window=64)],
    "two windows, blocks 32": [group(0, GroupKind.FULL, 32), group(1, GroupKind.SLIDING, 16, window=96),
                               group(2, GroupKind.SLIDING, 32, window=128)],
    "chunked 64": [FULL16, group(1, GroupKind.CHUNKED, 16, chunk=64)],
    "full only": [FULL16],
}


def needed(groups, keys, points):
    """Every key some resume point in `points` needs."""
    out = set()
    for p in points:
        for g in groups:
            blocks = g.restore_range(p) if g.recycling else range(p // g.block_size)
            out.update(keys(g.index, i) for i in blocks)
    return out


def random_held(rng, groups, keys, tokens):
    """A request's entries as stores leave them: full attention up to a point (maybe with a hole), windows at a few
    boundaries, and a few stray window blocks."""
    held = set()
    full_end = rng.randrange(0, tokens + 1)
    hole = rng.randrange(0, tokens) if rng.random() < 0.3 else None
    for g in groups:
        if not g.recycling:
            held.update(keys(g.index, i) for i in range(full_end // g.block_size)
                        if hole is None or not (i * g.block_size <= hole < (i + 1) * g.block_size))
    for _ in range(rng.randrange(0, 5)):
        p = rng.randrange(1, tokens // 32 + 1) * 32
        for g in groups:
            if g.recycling:
                held.update(keys(g.index, i) for i in g.restore_range(p))
    for g in groups:
        if g.recycling:
            for _ in range(rng.randrange(0, 4)):
                held.add(keys(g.index, rng.randrange(keys.num_blocks(g.index))))
    return held


def violations(groups, keys, held, order, alignment):
    """Steps of evicting `order` one key at a time where the victim was needed by a resume point still held while some
    held key was needed by none, or where the best hit grew."""
    held, bad, last_hit = set(held), 0, None
    for key in order:
        points = resume_points(groups, keys, held.__contains__, alignment)
        useful = needed(groups, keys, points)
        if key in useful and held - useful:
            bad += 1
        held.discard(key)
        hit = longest_hit(groups, keys, held.__contains__, 1 << 30, alignment)
        if last_hit is not None and hit > last_hit:
            bad += 1
        last_hit = hit
    return bad


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_what_no_point_needs_goes_before_anything_a_point_needs(name):
    groups = LAYOUTS[name]
    alignment = max(g.block_size for g in groups)
    rng = random.Random(sum(map(ord, name)))
    checked = 0
    for _ in range(60):
        keys = BlockKeys([f"h{i}" for i in range(rng.randrange(4, 48))], 16, groups)
        held = random_held(rng, groups, keys, keys.hashed_tokens())
        order = eviction_order(groups, keys, held.__contains__, alignment)
        assert sorted(order) == sorted(held)
        assert violations(groups, keys, held, order, alignment) == 0
        checked += len(order)
    assert checked > 500


def test_resume_points_are_where_the_lookup_would_hit():
    groups = LAYOUTS["two windows, blocks 32"]
    rng = random.Random(7)
    for _ in range(100):
        keys = BlockKeys([f"h{i}" for i in range(rng.randrange(4, 48))], 16, groups)
        held = random_held(rng, groups, keys, keys.hashed_tokens())
        points = resume_points(groups, keys, held.__contains__, 32)
        for upper in range(0, keys.hashed_tokens() + 1, 32):
            best = max((p for p in points if p <= upper), default=0)
            assert longest_hit(groups, keys, held.__contains__, upper, 32) == best


def test_a_points_windows_go_with_it_not_with_the_tokens_they_end_at():
    """Windows at 320 and 640 (window 64, blocks 16) over 640 tokens of full attention: the point at 640 is given up
    whole (its four window blocks, then full-attention blocks 20-39) before anything the point at 320 needs."""
    groups = LAYOUTS["window 64"]
    keys = BlockKeys([f"h{i}" for i in range(40)], 16, groups)
    held = {keys(0, i) for i in range(40)} | {keys(1, i) for i in (16, 17, 18, 19, 36, 37, 38, 39)}
    order = eviction_order(groups, keys, held.__contains__, 16)
    assert order[:4] == [keys(1, i) for i in (39, 38, 37, 36)]
    assert order[4:24] == [keys(0, i) for i in range(39, 19, -1)]
    assert order[24:28] == [keys(1, i) for i in (19, 18, 17, 16)]
    assert resume_points(groups, keys, held.__contains__, 16) == [320, 640]


def test_ranked_by_token_position_a_point_is_broken_while_useless_blocks_stay():
    """The order above is not what any tail-first order gives: by token position (the reverted ranking), a window
    reaching back past the previous point outlives its own point."""
    groups = LAYOUTS["two windows, blocks 32"]
    rng = random.Random(11)
    worse = 0
    for _ in range(60):
        keys = BlockKeys([f"h{i}" for i in range(rng.randrange(4, 48))], 16, groups)
        held = random_held(rng, groups, keys, keys.hashed_tokens())
        by_position = sorted(held, key=lambda k: -(next(i for i in range(keys.num_blocks(k[0]))
                                                        if keys(k[0], i) == k) + 1) * groups[k[0]].block_size)
        worse += violations(groups, keys, held, by_position, 32) > 0
    assert worse > 0


def test_spare_entries_are_ranked_tail_first_across_groups():
    groups = LAYOUTS["two windows, blocks 32"]
    keys = BlockKeys([f"h{i}" for i in range(16)], 16, groups)
    spare = {keys(1, 3), keys(1, 9), keys(2, 2), keys(2, 6)}  # ending at 64, 160, 96 and 224 tokens
    assert spare_order(groups, keys, spare.__contains__) == [keys(2, 6), keys(1, 9), keys(2, 2), keys(1, 3)]
