"""Longest prefix every KV cache group can restore from the CPU tier.

Full-attention and MLA groups need every block of the prefix; sliding-window and chunked-local groups need only
the blocks a request resuming at that point still attends to (its window or current chunk). The answer is the
longest hit, aligned to every group's block size, that satisfies all groups at once.
"""

from __future__ import annotations

from typing import Callable, Hashable, Sequence

from offload_connector.groups import GroupInfo, GroupKind

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


def hit_upper(groups: Sequence[GroupInfo], num_tokens: int, alignment: int) -> int:
    """The most tokens a hit may cover for a request of `num_tokens` tokens.

    A hit must leave a token for the step that produces the next output, but vLLM takes a hit of the whole prompt
    and computes its last token again (`_update_waiting_for_remote_kv`), as its own connector's loads do. So a
    prompt ending on a boundary of every group resumes there rather than one block earlier, where that recompute
    reads only blocks the load restores: vLLM allocates the hit's blocks for `num_tokens` computed tokens (null
    below each window there) and the token recomputed attends from the window at `num_tokens - 1`. That holds
    where both windows start in the same block: a sliding window unless it starts on the boundary; never a chunk
    that ends with the prompt (vLLM would null the whole chunk), never recurrent state (the state before the last
    token is not kept). The price is in the last bits: vLLM computes a one-token step through other kernels than a
    longer chunk, so the output's log-probabilities are those of a recompute whose last token is computed alone
    (the greedy tokens the same in the real-engine tests), not of one in longer chunks."""
    if num_tokens <= 0 or num_tokens % alignment:
        return num_tokens - 1
    for g in groups:
        if g.kind is GroupKind.MAMBA:
            return num_tokens - 1
        if g.recycling and g.first_live_block(num_tokens - 1) != g.first_live_block(num_tokens):
            return num_tokens - 1
    return num_tokens


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
