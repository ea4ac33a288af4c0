"""Requests for the simulated scheduler: deterministic tokens and vLLM's own block hasher."""

from __future__ import annotations

import random
from functools import lru_cache
from typing import Any, Sequence

_VOCAB = 30000


@lru_cache(maxsize=None)
def _hasher(hash_block_size: int, hash_lookahead_tokens: int = 0) -> Any:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    if hash_lookahead_tokens:  # vLLM 0.34 only: 0.32/0.33 never resolve a lookahead
        return get_request_block_hasher(hash_block_size, sha256, hash_lookahead_tokens)
    return get_request_block_hasher(hash_block_size, sha256)


def hash_lookahead(scheduler: Any) -> int:
    """The block hashes' lookahead the engine core would hash `scheduler`'s requests with (vLLM 0.34 resolves it
    from the speculative config and the connector's `supports_lookahead_block_hashes`; 0 before 0.34)."""
    return int(getattr(scheduler, "num_hash_lookahead_tokens", 0) or 0)


def tokens(seed: int, n: int) -> list[int]:
    """`n` deterministic token ids; different seeds give different (non-shared) prefixes."""
    rng = random.Random(seed)
    return [rng.randrange(100, _VOCAB) for _ in range(n)]


def make_request(request_id: str, prompt: Sequence[int], max_tokens: int, hash_block_size: int,
                 arrival_time: float | None = None, hash_lookahead_tokens: int = 0, **sampling: Any) -> Any:
    """A vLLM `Request` for `prompt`, hashed as the engine core would (`hash_lookahead_tokens`: `hash_lookahead` of
    the scheduler it goes to); `sampling` goes to its `SamplingParams` (e.g. `prompt_logprobs=1`)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
    kwargs = {}
    if arrival_time is not None:
        kwargs["arrival_time"] = arrival_time
    return Request(request_id=request_id, prompt_token_ids=list(prompt), sampling_params=params,
                   pooling_params=None, block_hasher=_hasher(hash_block_size, hash_lookahead_tokens), **kwargs)
