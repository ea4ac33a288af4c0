"""Longest prefix every KV cache group can restore from the CPU tier.

Full-attention and MLA groups need every block of the prefix; sliding-window and chunked-local groups need only
the blocks a request resuming at that point still attends to (its window or current chunk). The answer is the
longest hit, aligned to every group's block size, that satisfies all groups at once.
"""

from __future__ import annotations

from typing import Callable, Hashable, Sequence

from offload_connector.groups import GroupInfo

KeyFn = Callable[[int, int], Hashable]  # (group index, block index) -> tier key


class BlockKeys:
    """Maps (group, block index) to the tier key: the vLLM hash of the last hash-block inside that block.

    vLLM's block hashes are chained, so the hash at the end of a group block names the whole prefix up to it.
    """

    def __init__(self, block_hashes: Sequence[Hashable], hash_block_size: int, groups: Sequence[GroupInfo]):
        self._hashes = block_hashes
        self._ratio = [g.block_size // hash_block_size for g in groups]
        self.hash_block_size = hash_block_size

    def num_blocks(self, group: int) -> int:
        return len(self._hashes) // self._ratio[group]

    def hashed_tokens(self) -> int:
        return len(self._hashes) * self.hash_block_size

    def __call__(self, group: int, block: int) -> tuple[int, Hashable]:
        return (group, self._hashes[(block + 1) * self._ratio[group] - 1])

    def of_group(self, group: int) -> list[tuple[int, Hashable]]:
        """Every block's key of one group, in block order (what calling this for each block gives, in one pass)."""
        ratio = self._ratio[group]
        return [(group, h) for h in self._hashes[ratio - 1::ratio]]


def full_prefix_tokens(groups: Sequence[GroupInfo], keys: BlockKeys, is_ready: Callable[[Hashable], bool],
                       upper_tokens: int) -> int:
    """Tokens of the longest prefix whose every full-attention/MLA block is ready (`upper_tokens` if none is full).

    Where this runs past `longest_hit`, the prefix is shared with an earlier request but no window was stored at its
    end: the store planner keeps the window there (a junction) so the next request sharing it can resume."""
    hit = min(upper_tokens, keys.hashed_tokens())
    for g in groups:
        if g.recycling:
            continue
        limit = hit // g.block_size
        n = 0
        while n < limit and is_ready(keys(g.index, n)):
            n += 1
        hit = min(hit, n * g.block_size)
    return hit


def longest_hit(groups: Sequence[GroupInfo], keys: BlockKeys, is_ready: Callable[[Hashable], bool],
                upper_tokens: int, alignment: int, full_tokens: int | None = None) -> int:
    """Largest H <= upper_tokens, a multiple of `alignment`, such that every group can restore a request at H.

    `full_tokens`: `full_prefix_tokens` for the same arguments, if the caller already has it."""
    hit = full_prefix_tokens(groups, keys, is_ready, upper_tokens) if full_tokens is None else full_tokens
    hit -= hit % alignment
    recycling = [g for g in groups if g.recycling]
    while hit > 0:
        missing_at = None
        for g in recycling:
            for block in reversed(g.restore_range(hit)):
                if not is_ready(keys(g.index, block)):
                    missing_at = block * g.block_size
                    break
            if missing_at is not None:
                break
        if missing_at is None:
            return hit
        # Any hit whose restore range still contains the missing block fails too: jump below it.
        nxt = min(hit - alignment, missing_at)
        hit = nxt - nxt % alignment
    return 0
