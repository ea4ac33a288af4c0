"""The fair queue's record of a deferred load: who is ahead of whom, and which newer requests start with the whole
prefix a deferred load is to load (those are never held for it: whichever goes first, the other finds that prefix in
vLLM's GPU cache)."""

from dataclasses import dataclass, field

from offload_connector.scheduler.fairness import FairQueue


@dataclass
class Req:
    request_id: str
    arrival_time: float
    block_hashes: list = field(default_factory=list)
    priority: int = 0


def chain(*parts: str) -> list[str]:
    """Chained hashes, as vLLM's: each names its whole prefix."""
    out, acc = [], ""
    for p in parts:
        acc += p
        out.append(acc)
    return out


def test_a_newer_request_with_the_whole_loaded_prefix_shares_it():
    q = FairQueue(priority_policy=False)
    older = Req("old", 1.0, chain("a", "b", "c", "d"))
    q.defer(older, step=5, now=10, total=12, prefix_blocks=3)  # loads a, b, c
    load = q.oldest_ahead_of(Req("x", 2.0))
    assert load is not None and load.prefix_blocks == 3
    assert q.shares_prefix(load, Req("sib", 2.0, chain("a", "b", "c", "z")))  # branches after the loaded prefix
    assert q.shares_prefix(load, Req("same", 2.0, chain("a", "b", "c")))
    assert not q.shares_prefix(load, Req("short", 2.0, chain("a", "b")))  # only part of it
    assert not q.shares_prefix(load, Req("system", 2.0, chain("a", "y", "c", "d")))  # a common head only
    assert not q.shares_prefix(load, Req("none", 2.0))


def test_a_load_without_a_recorded_prefix_shares_with_nobody():
    q = FairQueue(priority_policy=False)
    q.defer(Req("old", 1.0, chain("a", "b")), step=0, now=4, total=4)  # prefix_blocks defaults to 0
    load = q.oldest_ahead_of(Req("x", 2.0))
    assert load is not None and load.prefix_hash is None
    assert not q.shares_prefix(load, Req("sib", 2.0, chain("a", "b")))
    q2 = FairQueue(priority_policy=False)
    q2.defer(Req("old", 1.0, chain("a")), step=0, now=4, total=4, prefix_blocks=3)  # more blocks than hashes
    load = q2.oldest_ahead_of(Req("x", 2.0))
    assert load.prefix_hash is None and not q2.shares_prefix(load, Req("sib", 2.0, chain("a", "b", "c")))


def test_a_re_deferral_keeps_its_first_step_and_takes_the_new_prefix():
    q = FairQueue(priority_policy=False, grace_steps=10)
    r = Req("old", 1.0, chain("a", "b", "c"))
    q.defer(r, step=3, now=5, total=5, prefix_blocks=1)
    q.defer(r, step=9, now=6, total=7, prefix_blocks=2)
    load = q.oldest_ahead_of(Req("x", 2.0))
    assert (load.since, load.now, load.prefix_blocks, load.prefix_hash) == (3, 6, 2, "ab")
    assert not q.holds_all(load, 12) and q.holds_all(load, 13)
