"""The replay with each request's accepted drafts drawn from its own position (common random numbers for every
column: the same request at the same token accepts the same number of drafts whatever else the step holds), instead
of one stream consumed in step order. A diagnostic of the replay's noise under speculative decoding, run as
`python per_position.py replay ...` with the replay's own arguments; nothing else changes."""
import random
import sys
import zlib

from offload_bench.sim import drafts as D


def sample(self, sched, out):
    req_ids = list(out.num_scheduled_tokens)
    spec = getattr(out, "scheduled_spec_decode_tokens", None) or {}
    sampled = []
    for rid in req_ids:
        req = sched.requests[rid]
        if req.num_computed_tokens < req.num_tokens:
            sampled.append([])
            continue
        drafts = len(spec.get(rid, ()))
        key = zlib.crc32(f"{rid}:{req.num_computed_tokens}".encode())
        accepted = random.Random(key).randint(0, drafts) if drafts else 0
        self.scheduled += drafts
        self.accepted += accepted
        sampled.append([7] * (1 + accepted))
    return req_ids, sampled


D.DraftSampler.sample = sample
from offload_bench.cli import main  # noqa: E402

main(sys.argv[1:])
