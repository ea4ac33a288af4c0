"""What a simulated step samples per scheduled request, speculative drafts included (seeded, shared by the driver of
our connector and the one of vLLM's, so both columns of a replay draw from the same stream; they accept alike only
while they schedule alike, or with `DraftSampler.per_position`)."""

from __future__ import annotations

import random
import zlib
from typing import Any


class DraftSampler:
    """A prefill chunk short of the prompt's end samples nothing. Any other scheduled request samples its accepted
    drafts, a seeded uniform 0..k of the k drafts it was scheduled with (vLLM rolls the rest back), then the bonus
    token. Every token is 7, like the simulated model's samples. `rng` is also the stream the synchronous proposer
    draws from (`SchedulerDriver._feed_drafts`), so the order of draws, and every replay figure, stays as it was.

    The accepted counts come from that one stream in step order, so two columns that schedule differently draw
    different counts for the same request. `per_position` (off by default, which every figure so far was measured
    with) draws each from the request and its position instead: the same request at the same token accepts alike in
    every column (the hybrids page, "Throughput 0.9999x under MTP")."""

    per_position = False

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.scheduled = 0  # drafts scheduled
        self.accepted = 0  # drafts accepted

    def sample(self, sched: Any, out: Any) -> tuple[list[str], list[list[int]]]:
        """The scheduled request ids of `out` (vLLM's SchedulerOutput) and what each samples."""
        req_ids = list(out.num_scheduled_tokens)
        spec = getattr(out, "scheduled_spec_decode_tokens", None) or {}
        sampled: list[list[int]] = []
        for rid in req_ids:
            req = sched.requests[rid]
            if req.num_computed_tokens < req.num_tokens:
                sampled.append([])
                continue
            drafts = len(spec.get(rid, ()))
            accepted = self._accepted(rid, req.num_computed_tokens, drafts) if drafts else 0
            self.scheduled += drafts
            self.accepted += accepted
            sampled.append([7] * (1 + accepted))
        return req_ids, sampled

    def _accepted(self, rid: str, position: int, drafts: int) -> int:
        if self.per_position:
            return random.Random(zlib.crc32(f"{rid}:{position}".encode())).randint(0, drafts)
        return self.rng.randint(0, drafts)


class DraftCounts:
    """For a driver holding a `DraftSampler` as `self.drafts`: its counts under the names the replay and the fuzz
    read (`drafts_scheduled`, `drafts_accepted`)."""

    drafts: DraftSampler

    @property
    def drafts_scheduled(self) -> int:
        return self.drafts.scheduled

    @property
    def drafts_accepted(self) -> int:
        return self.drafts.accepted
