from offload_connector.groups import GroupInfo, GroupKind
from offload_connector.scheduler.lookup import BlockKeys, longest_hit


def group(i, kind, bs, window=0, chunk=0):
    return GroupInfo(index=i, kind=kind, block_size=bs, block_bytes=1, num_layers=1, sliding_window=window,
                     chunk_size=chunk, live_ceiling=100)


FULL = group(0, GroupKind.FULL, 32)
SWA = group(1, GroupKind.SLIDING, 16, window=64)
CHUNK = group(1, GroupKind.CHUNKED, 16, chunk=64)


def ready_set(groups, hashes, upto_tokens, recycle_boundary=None):
    keys = BlockKeys(hashes, 16, groups)
    ready = set()
    for g in groups:
        if g.recycling:
            if recycle_boundary is not None:
                ready.update(keys(g.index, i) for i in g.restore_range(recycle_boundary))
        else:
            ready.update(keys(g.index, i) for i in range(upto_tokens // g.block_size))
    return keys, ready


def test_full_only_prefix_and_alignment():
    hashes = [f"h{i}" for i in range(20)]  # 320 tokens of hash blocks
    keys, ready = ready_set([FULL], hashes, 256)
    assert longest_hit([FULL], keys, ready.__contains__, 1000, 32) == 256
    assert longest_hit([FULL], keys, ready.__contains__, 200, 32) == 192


def test_sliding_window_needs_only_window_at_stored_boundary():
    groups = [FULL, SWA]
    hashes = [f"h{i}" for i in range(40)]
    keys, ready = ready_set(groups, hashes, 640, recycle_boundary=448)
    # Full attention has 640 tokens, the window exists only at 448: the hit is 448, not 640.
    assert longest_hit(groups, keys, ready.__contains__, 10_000, 32) == 448
    # Needed sliding blocks at 448: tokens [385, 448) -> blocks 24..27, nothing earlier.
    assert list(SWA.restore_range(448)) == [24, 25, 26, 27]


def test_chunked_local_needs_current_chunk_only():
    groups = [FULL, CHUNK]
    hashes = [f"h{i}" for i in range(39)]  # 624 tokens hashed: full attention holds 608 (aligned)
    keys, ready = ready_set(groups, hashes, 624, recycle_boundary=608)
    assert list(CHUNK.restore_range(576)) == []  # a chunk boundary needs nothing
    assert list(CHUNK.restore_range(608)) == [36, 37]
    assert longest_hit(groups, keys, ready.__contains__, 10_000, 32) == 608
    ready.discard(keys(1, 36))
    # Without block 36 the best hit is the chunk boundary at 576, which needs no chunked-local block at all.
    assert longest_hit(groups, keys, ready.__contains__, 10_000, 32) == 576


def test_missing_window_block_means_no_hit_there():
    groups = [FULL, SWA]
    hashes = [f"h{i}" for i in range(40)]
    keys, ready = ready_set(groups, hashes, 640, recycle_boundary=448)
    ready.discard(keys(1, 25))
    assert longest_hit(groups, keys, ready.__contains__, 10_000, 32) == 0


def test_hit_upper_takes_the_whole_prompt_only_where_the_recomputed_token_reads_loaded_blocks():
    from offload_connector.scheduler.lookup import hit_upper
    assert hit_upper([FULL], 640, 32) == 640
    assert hit_upper([FULL], 650, 32) == 649  # not on a boundary: one token short, as vLLM's own lookup
    assert hit_upper([FULL], 656, 32) == 655  # a boundary of 16, not of the hit alignment 32
    assert hit_upper([FULL, SWA], 640, 32) == 640  # the window at 639 starts in the block the one at 640 does
    # a window that starts on a block boundary at the prompt's end starts a block earlier at 639: vLLM would null it
    assert hit_upper([FULL, group(1, GroupKind.SLIDING, 16, window=65)], 640, 32) == 639
    assert hit_upper([FULL, CHUNK], 640, 32) == 639  # the prompt ends a chunk: vLLM nulls the chunk
    assert hit_upper([FULL, CHUNK], 608, 32) == 608  # inside a chunk: the chunk at 607 and 608 is the same
    mamba = GroupInfo(index=1, kind=GroupKind.MAMBA, block_size=32, block_bytes=1, num_layers=1, live_ceiling=1)
    assert hit_upper([FULL, mamba], 640, 32) == 639  # the state before the last token is not kept
    assert hit_upper([FULL], 0, 32) == -1
