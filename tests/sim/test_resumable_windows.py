"""Sliding windows are stored where a later request can resume: checkpoints, junctions, the last block of a prompt.

Each scenario runs on vLLM's real scheduler (hand-built layout: full attention + a 64-token sliding window, blocks of
16) with the tag-checking copy engine, so a load is also checked to carry the blocks that were stored.
"""

import pytest

from offload_connector.scheduler.windows import store_points
from offload_bench.sim.custom import build_custom
from offload_bench.sim.driver import LoadContentError, SchedulerDriver
from offload_bench.sim.requests import make_request, tokens
from offload_bench.sim.scenarios import connector_config
from offload_bench.sim.tagcopy import TagCopier

GROUPS = (("full", 16, 0), ("sliding", 16, 64))


def test_store_points():
    # Checkpoints every 256 tokens, the last full block before the prompt's end (992), the prompt's end (1000 -> 992
    # with 16-token alignment: the same point) and the latest boundary once past the prompt.
    assert store_points(0, 800, 1000, 16, 256) == [256, 512, 768]
    assert store_points(800, 992, 1000, 16, 256) == [992]
    assert store_points(992, 1024, 1000, 16, 256) == [1024]
    # A prompt ending on a boundary: where vLLM cannot take the whole prompt a resend resumes one block earlier, so
    # both boundaries are kept; where it can, the end is the one point.
    assert store_points(0, 640, 640, 16, 0) == [624, 640]
    assert store_points(0, 640, 640, 16, 0, resend_upper=639) == [624, 640]
    assert store_points(0, 640, 640, 16, 0, resend_upper=640) == [640]
    # Junctions count only inside the range; spacing is rounded down to the alignment; 0 disables checkpoints.
    assert store_points(0, 512, 2000, 16, 0, junctions={96, 704}) == [96]
    assert store_points(0, 512, 2000, 32, 100) == [96, 192, 288, 384, 480]
    assert store_points(512, 512, 2000, 16, 256) == []


def _driver(**extra):
    # The rules for where windows are stored are what these tests check: spare windows (every other boundary, in
    # room nobody uses) off unless a test turns them on.
    extra.setdefault("spare_windows", False)
    sched, hbs = build_custom(GROUPS, num_blocks=400, max_num_batched_tokens=128, max_model_len=4096,
                              kv_transfer_config=connector_config("exact", 1 << 30, **extra))
    return SchedulerDriver(sched, TagCopier(1)), hbs


def _serve(drv, rid, prompt, hbs, max_tokens=2):
    drv.add([make_request(rid, prompt, max_tokens, hbs)])
    res = drv.run()
    assert not res.stalled and rid in drv.finished
    drv.sched.reset_prefix_cache()  # later requests must come back from the CPU tier, not the GPU prefix cache
    return drv.side.counters.loaded_tokens


@pytest.mark.parametrize("spacing, expected", [(256, 512), (0, 0)])
def test_shared_prefix_ending_mid_prompt_resumes_at_the_checkpoint_below_it(spacing, expected):
    drv, hbs = _driver(window_checkpoint_tokens=spacing)
    a = tokens(1, 1000)
    _serve(drv, "a", a, hbs)
    loaded = _serve(drv, "b", a[:700] + tokens(2, 300), hbs)
    # b shares 700 tokens with a: the last point with a stored window at or below them is the 512 checkpoint.
    assert loaded == expected


def test_junction_stores_the_window_where_two_requests_diverge():
    drv, hbs = _driver(window_checkpoint_tokens=0)
    a = tokens(1, 1000)
    _serve(drv, "a", a, hbs)
    # b shares a's first 704 tokens: a's full-attention blocks are there, a window is not, so b loads nothing ...
    assert _serve(drv, "b", a[:704] + tokens(2, 300), hbs) == 0
    # ... but b stored its window at 704, so a third request sharing the same prefix resumes exactly there.
    assert _serve(drv, "c", a[:704] + tokens(3, 200), hbs) == 704


def test_the_junction_is_handed_to_vllm_which_keeps_the_window_on_the_gpu():
    """vLLM (0.32 to 0.34) keeps a sliding window in the GPU prefix cache at `request.shared_prefix_boundary`: with
    the junction there, a third request sharing the prefix resumes at it from the GPU, loading nothing."""
    drv, hbs = _driver(window_checkpoint_tokens=0)
    a = tokens(1, 1000)
    _serve(drv, "a", a, hbs)
    b = make_request("b", a[:704] + tokens(2, 300), 2, hbs)
    drv.add([b])
    assert not drv.run().stalled and b.shared_prefix_boundary == 704
    loaded = drv.side.counters.loaded_tokens
    local: dict[str, int] = {}  # the GPU prefix-cache hit vLLM reports at each request's first lookup
    lookup = drv.side.get_num_new_matched_tokens
    drv.side.get_num_new_matched_tokens = lambda r, n: (local.setdefault(r.request_id, n), lookup(r, n))[1]
    c = make_request("c", a[:704] + tokens(3, 200), 2, hbs)
    drv.add([c])
    assert not drv.run().stalled
    assert local["c"] == 704 and drv.side.counters.loaded_tokens == loaded  # from the GPU prefix cache


def test_a_prompt_sent_again_loads_to_its_end_and_vllm_recomputes_the_last_token():
    """A prompt whose length is a multiple of the block size is hit whole (`lookup.hit_upper`): vLLM takes the load
    as the whole prompt computed and computes its last token again, which here reads only loaded blocks (the tag
    check verifies the window at 639). Before, the hit stopped at 624 and 16 tokens were recomputed."""
    drv, hbs = _driver(window_checkpoint_tokens=0)
    a = tokens(4, 640)
    _serve(drv, "a", a, hbs)
    scheduled: list[int] = []
    reserved_while_loading: list[int] = []
    schedule = drv.sched.schedule

    def recording_schedule():
        out = schedule()
        scheduled.extend(n for rid, n in out.num_scheduled_tokens.items() if rid == "a-again")
        req = drv.sched.requests.get("a-again")
        if req is not None and req.status.name == "WAITING_FOR_REMOTE_KVS":
            # vLLM counts the whole prompt computed while the load is in flight; the ledger still reserves the
            # block its first decode step takes (641 tokens: a 41st block of each group)
            rows = [r for r in drv.side.snapshot().rows if r.request_id == "a-again"]
            reserved_while_loading.append(sum(rows[0].remaining) if rows else 0)
        return out
    drv.sched.schedule = recording_schedule
    assert _serve(drv, "a-again", list(a), hbs) == 640
    assert scheduled[0] == 1  # the prompt's last token, then one decode step
    assert reserved_while_loading and min(reserved_while_loading) == 2, reserved_while_loading


def test_with_spare_windows_a_roomy_tier_resumes_at_the_last_boundary():
    """Spare windows (the default) fill room no regular entry uses: with the tier far from full, a prefix shared up
    to any point resumes at the last block boundary below it, whatever the checkpoints; nothing was evicted."""
    for spacing in (0, 8192):
        drv, hbs = _driver(window_checkpoint_tokens=spacing, spare_windows=True)
        a = tokens(1, 1000)
        _serve(drv, "a", a, hbs)
        assert _serve(drv, "b", a[:700] + tokens(2, 300), hbs) == 688
        tier = drv.side.tier
        assert tier.evictions == 0 and tier.stats().spare_entries > 0


def test_chunked_local_blocks_are_regular_entries_sliding_windows_spare():
    """A chunk's windows nest (resuming anywhere in it needs its blocks from the chunk's start), so with spare windows
    on every chunked-local block is a regular entry, like a full-attention block, while the sliding windows between
    the rules' points are spare. A prefix shared to a point inside the first chunk resumes at the last boundary
    below it."""
    groups = (("full", 16, 0), ("chunked", 16, 512), ("sliding", 16, 64))
    sched, hbs = build_custom(groups, num_blocks=400, max_num_batched_tokens=128, max_model_len=4096,
                              kv_transfer_config=connector_config("exact", 1 << 30, window_checkpoint_tokens=0))
    drv = SchedulerDriver(sched, TagCopier(1))
    a = tokens(1, 1000)
    _serve(drv, "a", a, hbs)
    tier, layout = drv.side.tier, drv.side.layout
    kinds = {g.index: g.kind.value for g in layout.groups}
    stored = [k for k in tier.keys() if tier.is_ready(k)]
    chunked = [k for k in stored if kinds[k[0]] == "chunked_local"]
    sliding = [k for k in stored if kinds[k[0]] not in ("chunked_local", "full_attention")]
    # Every block of the 62 full ones but the first chunk's last: a resume at 512 starts a new chunk, so no point
    # needs it.
    assert len(chunked) == 1000 // 16 - 1 and not any(tier.is_spare(k) for k in chunked)
    assert sliding and any(tier.is_spare(k) for k in sliding)
    assert _serve(drv, "b", a[:300] + tokens(2, 300), hbs) == 288


@pytest.mark.parametrize("groups, whole", [
    ((("full", 16, 0), ("sliding", 16, 64)), True),
    # a window of 65 starts on a block boundary at 640, one block earlier at 639: vLLM would null that block
    ((("full", 16, 0), ("sliding", 16, 65)), False),
    # a chunk ending with the prompt: vLLM nulls the whole chunk the recomputed token reads
    ((("full", 16, 0), ("chunked", 16, 64)), False),
])
def test_a_whole_prompt_hit_only_where_the_recomputed_token_reads_loaded_blocks(groups, whole, monkeypatch):
    """Where the recomputed last token would read a block vLLM allocates as null for a hit of the whole prompt, the
    hit stops a block short; forcing the whole prompt there makes the tag check fail, so the rule is what keeps the
    load right, not an accident of the layout."""
    def serve_twice(drv, hbs):
        a = tokens(4, 640)
        _serve(drv, "a", a, hbs)
        return _serve(drv, "a-again", list(a), hbs)

    def driver():
        sched, hbs = build_custom(groups, num_blocks=400, max_num_batched_tokens=128, max_model_len=4096,
                                  kv_transfer_config=connector_config("exact", 1 << 30, window_checkpoint_tokens=0))
        return SchedulerDriver(sched, TagCopier(1)), hbs

    assert serve_twice(*driver()) == (640 if whole else 624)
    if not whole:
        import offload_connector.scheduler.admission as admission
        monkeypatch.setattr(admission, "hit_upper", lambda groups, n, alignment: n)
        with pytest.raises(LoadContentError):
            serve_twice(*driver())
