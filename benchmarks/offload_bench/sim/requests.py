"""Requests for the simulated scheduler: deterministic tokens and vLLM's own block hasher."""

from __future__ import annotations

import random
from functools import lru_cache
from typing import Any, Sequence

_VOCAB = 30000


@lru_cache(maxsize=None)
def _hasher(hash_block_size: int) -> Any:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    return get_request_block_hasher(hash_block_size, sha256)


def tokens(seed: int, n: int) -> list[int]:
    """`n` deterministic token ids; different seeds give different (non-shared) prefixes."""
    rng = random.Random(seed)
    return [rng.randrange(100, _VOCAB) for _ in range(n)]


def make_request(request_id: str, prompt: Sequence[int], max_tokens: int, hash_block_size: int,
                 arrival_time: float | None = None, **sampling: Any) -> Any:
    """A vLLM `Request` for `prompt`; `sampling` goes to its `SamplingParams` (e.g. `prompt_logprobs=1`)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
    kwargs = {}
    if arrival_time is not None:
        kwargs["arrival_time"] = arrival_time
    return Request(request_id=request_id, prompt_token_ids=list(prompt), sampling_params=params,
                   pooling_params=None, block_hasher=_hasher(hash_block_size), **kwargs)
