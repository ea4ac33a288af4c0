"""vLLM's async-load admission count with the upstream fix for recycling groups, applied to ONE scheduler.

What is wrong in vLLM 0.32.0 / 0.33.0 (the-stall.md in the shared notes): the async-load admission path asks
`SingleTypeKVCacheManager.get_num_blocks_to_allocate(..., apply_admission_cap=True)` in two places,

- `KVCacheManager.allocate_slots(..., full_sequence_must_fit=True)` (the full-sequence gate, first allocation of a
  WAITING request, with its local prefix hit as `new_computed_blocks`), and
- `Scheduler._request_remaining_blocks` (the reservation every in-flight load or prefill keeps for itself, summed
  into `reserved_blocks` when another load is admitted; the request already holds its blocks).

For a recycling group (`SlidingWindowManager`, `ChunkedLocalAttentionManager`) vLLM caps the requirement at the
group's `max_admission_blocks_per_request` and then subtracts the *length* of the request's block list: the held
path subtracts `len(req_to_blocks[rid])`, a list that pads every position left of the window with null blocks; the
first-allocation path subtracts `max(skipped blocks, local blocks)`, an absolute block index. Both are block
positions, not live blocks, so once the loaded prefix spans more blocks than the cap (3-4k tokens on Gemma-4-31B)
every sliding group counts 0. On the Gemma seed (two 23,000-token requests returning with 21,952 loaded tokens) the
second load is then admitted next to the first and the pool wedges at 175 free blocks.

The fix (the upstream remedy), per recycling group of block size `b` and cap `cap`, for a request with
`c = total_computed_tokens` (local + external; `Scheduler._request_remaining_blocks` passes
`request.num_computed_tokens`) and target `T = num_tokens`:

    first  = min(get_num_skipped_tokens(c) // b, cdiv(T, b))   # first block still inside the window / chunk
    need   = min(cdiv(T, b) - first, cap)                       # live blocks from there through the target
    blocks = req_to_blocks[rid] + new_computed_blocks           # position-aligned, nulls where skipped
    real   = non-null blocks of blocks[first : cdiv(T, b)]      # already live in that range
    count  = max(need - len(real), 0)
             + |{blk in real : blk.ref_cnt == 0}|               # local hits still in the free queue (touching
                                                                #   them takes them out of it, as vLLM counts)
             + 1 if vLLM's partial-hit copy-on-write applies     # unchanged from vLLM

Only calls with `apply_admission_cap=True` on recycling groups change; per-step allocation
(`apply_admission_cap=False`), full-attention and every other group kind run vLLM's own code.

How it is applied: `apply_admission_fix(scheduler)` replaces the bound method `get_num_blocks_to_allocate` on that
scheduler's own manager *instances* (`scheduler.kv_cache_manager.coordinator.single_type_managers`). The classes
are untouched, so other schedulers in the same process (the other replay columns) keep unpatched vLLM, and the
connector package's production code is not involved at all. The method's parameters are looked up by name in each
manager's signature (identical in vLLM 0.32.0 and 0.33.0: `request_id, num_tokens, new_computed_blocks,
total_computed_tokens, num_local_computed_tokens, num_tokens_main_model, apply_admission_cap, prefill_end`), so a
vLLM that renames one is refused when the patch is applied instead of being miscounted.

How exact it is (tests/sim/test_vllm_patched.py measures it against the blocks a request really takes from the pool):
equal per group whenever the rest of the prompt fits in the window plus the in-flight tokens (the async-load case
the stall comes from: the Gemma seed reserves 5 x 66 + 33 = 363 blocks and the request then takes exactly 363).
With a longer remainder the cap binds and the count is an upper bound (by the cap's one-block alignment slack),
except for a local prefix hit still *shared* with another request: those blocks are subtracted as live, but the
window later releases them without returning anything to the pool, so the count falls short by up to the shared
hit blocks inside the window. The patch applies the formula as described upstream; it does not correct that.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

__all__ = ["apply_admission_fix", "fixed_admission_blocks", "is_patched", "recycling_managers"]

_MARK = "_offload_connector_admission_fix"
_NEEDED = ("request_id", "num_tokens", "new_computed_blocks", "total_computed_tokens", "num_local_computed_tokens",
           "apply_admission_cap")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def recycling_managers(scheduler: Any) -> list[tuple[int, Any]]:
    """(group index, manager) for each group whose manager recycles blocks and carries an admission cap."""
    from vllm.v1.core.single_type_kv_cache_manager import ChunkedLocalAttentionManager, SlidingWindowManager

    out = []
    for i, mgr in enumerate(scheduler.kv_cache_manager.coordinator.single_type_managers):
        # Exact classes: a subclass could free blocks on a different rule than the one the formula assumes.
        if type(mgr) in (SlidingWindowManager, ChunkedLocalAttentionManager) and \
                getattr(mgr, "max_admission_blocks_per_request", None) is not None:
            out.append((i, mgr))
    return out


def fixed_admission_blocks(manager: Any, request_id: str, num_tokens: int, new_computed_blocks: Sequence[Any],
                           total_computed_tokens: int, num_local_computed_tokens: int) -> int:
    """The fixed admission count of one recycling group (the formula in the module docstring)."""
    b = manager.block_size
    last = _cdiv(num_tokens, b)
    first = min(manager.get_num_skipped_tokens(total_computed_tokens) // b, last)
    need = min(last - first, manager.max_admission_blocks_per_request)
    # Held blocks and the local prefix hit are both indexed by block position from 0 (skipped positions hold the
    # null block), so their concatenation lines up with [first, last).
    held = manager.req_to_blocks.get(request_id, ())
    blocks = list(held) + list(new_computed_blocks)
    real = [blk for blk in blocks[first:last] if not blk.is_null]
    count = max(need - len(real), 0) + sum(1 for blk in real if blk.ref_cnt == 0)
    # A local hit ending inside a block gets a private copy of that block (vLLM's CoW), one more block; kept as
    # vLLM counts it, and only where the manager has that rule.
    partial = getattr(manager, "_has_partial_local_hit", None)
    if partial is not None and request_id not in manager.num_cached_block and \
            partial(new_computed_blocks, num_local_computed_tokens):
        count += 1
    return count


def _wrap(manager: Any) -> Callable[..., int]:
    original = manager.get_num_blocks_to_allocate  # bound to this instance
    sig = inspect.signature(original)
    missing = [p for p in _NEEDED if p not in sig.parameters]
    if missing:
        raise RuntimeError(f"{type(manager).__name__}.get_num_blocks_to_allocate has no {missing}; "
                           "this vLLM is not one the admission fix was written for")
    cap_pos = list(sig.parameters).index("apply_admission_cap")

    def get_num_blocks_to_allocate(*args: Any, **kwargs: Any) -> int:
        capped = kwargs["apply_admission_cap"] if "apply_admission_cap" in kwargs else (
            len(args) > cap_pos and bool(args[cap_pos]))
        if not capped:  # per-step allocation: vLLM's own predictor is exact there
            return original(*args, **kwargs)
        a = sig.bind(*args, **kwargs).arguments
        return fixed_admission_blocks(manager, a["request_id"], a["num_tokens"], a["new_computed_blocks"],
                                      a["total_computed_tokens"], a["num_local_computed_tokens"])

    # inspect.signature() follows __wrapped__, so whoever binds arguments by name still sees vLLM's parameters.
    get_num_blocks_to_allocate.__wrapped__ = original  # type: ignore[attr-defined]
    return get_num_blocks_to_allocate


def apply_admission_fix(scheduler: Any) -> list[int]:
    """Patch this scheduler's recycling-group managers (instances only). Returns the patched group indices.

    Idempotent: a manager already patched is left as it is.
    """
    patched = []
    for i, mgr in recycling_managers(scheduler):
        if not getattr(mgr, _MARK, False):
            mgr.get_num_blocks_to_allocate = _wrap(mgr)
            setattr(mgr, _MARK, True)
        patched.append(i)
    setattr(scheduler, _MARK, tuple(patched))
    return patched


def is_patched(scheduler: Any) -> bool:
    """Whether `apply_admission_fix` ran on this scheduler (and every recycling manager of it is wrapped)."""
    return getattr(scheduler, _MARK, None) is not None and all(
        getattr(m, _MARK, False) for _, m in recycling_managers(scheduler))
