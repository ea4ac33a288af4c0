"""verify_loads' block checksums (offload_connector/worker/checksum.py): the definition, its two bodies, what it
detects, and on a GPU (skipped without one) the same bits as on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from offload_connector.worker.checksum import CHUNK_BYTES, BlockChecksummer, SlotChecksums

HAS_CUDA = torch.cuda.is_available()
MASK = (1 << 64) - 1
K = 0x9E3779B97F4A7C15


def reference(pages, segments, offsets, group, blocks):
    """The documented definition in plain Python integers: per page row, words of the widest width the layout
    allows, chunks of up to 512 bytes (a divisor of the row's words), weights (2 * byte offset in the slot + 1) * K."""
    out = []
    for b in blocks:
        total = 0
        for t in segments[group]:
            page = pages[t]
            row = page[b].numpy().tobytes()
            n = len(row)
            width = next(w for w in (8, 4, 2, 1) if n % w == 0 and page.stride(0) % w == 0
                         and page.storage_offset() % w == 0)
            words = [int.from_bytes(row[i:i + width], "little", signed=True) for i in range(0, n, width)]
            per_chunk = int(np.gcd(len(words), max(1, CHUNK_BYTES // width)))
            for j in range(len(words) // per_chunk):
                s = sum(words[j * per_chunk:(j + 1) * per_chunk])
                offset = offsets[t] + j * per_chunk * width
                total += s * ((2 * offset + 1) * K)
        total &= MASK
        out.append(total - (1 << 64) if total >= 1 << 63 else total)
    return out


def pages_of(page_bytes, pads, blocks=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    views, offsets, off = [], [], 0
    for page, pad in zip(page_bytes, pads):
        base = torch.randint(0, 256, (blocks, page + pad), dtype=torch.uint8, generator=gen)
        views.append(base[:, :page])
        offsets.append(off)
        off += page
    return views, offsets


@pytest.mark.parametrize("page_bytes, pads", [
    ((4096, 4096), (0, 256)),  # int64 words, a padded row
    ((1536, 3000), (8, 12)),  # 1,536 bytes: 192 words in chunks of 64; 3,000: 375 words, chunks of 25 (gcd)
    ((1030,), (2,)),  # int16 words (row stride 1,032 is not a multiple of 4)
    ((999,), (0,)),  # bytes
    ((262144, 4096), (256, 0)),  # a row past the serial body's op size: reduced in pieces
])
def test_matches_the_definition_and_both_bodies_agree(page_bytes, pads):
    views, offsets = pages_of(page_bytes, pads)
    segments = [list(range(len(views)))]
    ck = BlockChecksummer(views, segments, offsets, batch_bytes=3 * max(page_bytes))  # several gather batches
    blocks = [7, 0, 11, 3, 3, 5]
    want = reference(views, segments, offsets, 0, blocks)
    assert ck.compute(0, blocks, method="serial").tolist() == want
    assert ck.compute(0, blocks, method="gather").tolist() == want
    assert ck.compute(0, []).tolist() == []


def test_detects_a_flipped_bit_moved_chunks_and_swapped_pages():
    views, offsets = pages_of((4096, 4096), (0, 0))
    ck = BlockChecksummer(views, [[0, 1]], offsets)
    before = ck.compute(0, [2]).item()
    views[1][2, 100] ^= 0x01  # one bit
    assert ck.compute(0, [2]).item() != before
    views[1][2, 100] ^= 0x01
    assert ck.compute(0, [2]).item() == before
    # Two 512-byte chunks swapped inside a page: every word intact, positions wrong.
    row = views[0][2]
    a, b = row[:CHUNK_BYTES].clone(), row[CHUNK_BYTES:2 * CHUNK_BYTES].clone()
    row[:CHUNK_BYTES], row[CHUNK_BYTES:2 * CHUNK_BYTES] = b, a
    assert ck.compute(0, [2]).item() != before
    row[:CHUNK_BYTES], row[CHUNK_BYTES:2 * CHUNK_BYTES] = a, b
    # The block's two pages swapped (layer order): weights depend on the offset inside the slot.
    p0, p1 = views[0][2].clone(), views[1][2].clone()
    views[0][2], views[1][2] = p1, p0
    assert ck.compute(0, [2]).item() != before
    # The negation debug.corrupt_load applies (top bit of every other byte).
    views[0][2], views[1][2] = p0, p1
    views[0][2][1::2] ^= 0x80
    assert ck.compute(0, [2]).item() != before


def test_slot_table_records_landed_stores_and_flags_missing_or_different_sums():
    views, offsets = pages_of((512,), (0,))
    table = SlotChecksums(BlockChecksummer(views, [[0]], offsets), num_slots=4)
    sums = table.measure([0, 0], [5, 6]).values()
    assert table.mismatches([1, 2], sums).tolist() == [0, 1]  # nothing stored yet
    table.record([1, 2], sums)
    assert table.mismatches([1, 2], sums).size == 0
    assert table.mismatches([2, 1], sums).tolist() == [0, 1]  # the other slot's sums
    table.invalidate([2])
    assert table.mismatches([1, 2], sums).tolist() == [1]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_gives_the_cpu_bits_without_copying_the_blocks():
    views, offsets = pages_of((65536, 1536), (256, 8), blocks=64)
    segments = [[0, 1]]
    blocks = list(range(63, 0, -3))
    cpu = BlockChecksummer(views, segments, offsets).compute(0, blocks)
    dev_views = [v.to("cuda") for v in views]  # contiguous copies: rows without padding, other offsets unchanged
    dev = SlotChecksums(BlockChecksummer(dev_views, segments, offsets), 64)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        pending = dev.measure([0] * len(blocks), blocks, stream)
    assert pending.values().tolist() == cpu.tolist()



def test_a_job_mixing_groups_gets_its_sums_in_job_order():
    views, offsets = pages_of((512, 512, 1024), (0, 0, 8))
    ck = BlockChecksummer(views, [[0, 1], [2]], [0, 512, 0])
    table = SlotChecksums(ck, num_slots=4)
    groups, blocks = [1, 0, 1, 0], [4, 4, 9, 2]
    got = table.measure(groups, blocks).values().tolist()
    assert got == [ck.compute(g, [b]).item() for g, b in zip(groups, blocks)]
    assert got[0] != got[1]  # same block id, different groups (different pages)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_transfer_engine_verifies_loads_in_stream_order():
    """Stores and loads on their CUDA streams with verify_loads: clean loads pass, a flipped host byte fails."""
    from offload_connector.kernels import ReferenceCopier, allocate_host_tier
    from offload_connector.transfer_jobs import TransferJob
    from offload_connector.worker.transfers import TransferEngine

    page = 4096
    dev = [torch.randint(0, 256, (32, page + 256), dtype=torch.uint8, device="cuda")[:, :page] for _ in range(2)]
    tier = allocate_host_tier(16, 2 * page, pin=False)
    host = [tier.tensor[:, i * page:(i + 1) * page] for i in range(2)]
    table = SlotChecksums(BlockChecksummer(dev, [[0, 1]], [0, page]), 16)
    engine = TransferEngine(ReferenceCopier(dev, host, [[0, 1]]), 1, [2 * page], torch.device("cuda"),
                            checksums=table)
    engine.submit_store(TransferJob(1, "a", ((3, 4),), ((0, 1),)))
    assert [r.ok for r in engine.drain()] == [True]
    engine.submit_load(TransferJob(2, "b", ((10, 11),), ((0, 1),)))
    assert [r.ok for r in engine.drain()] == [True]
    assert all(torch.equal(d[10], d[3]) and torch.equal(d[11], d[4]) for d in dev)
    tier.tensor[1, 5] ^= 1
    engine.submit_load(TransferJob(3, "c", ((12,),), ((1,),)))
    (result,) = engine.drain()
    assert not result.ok and result.verify_failed


@pytest.mark.parametrize("rows_that_fit", [5, 1, 0])
def test_a_device_too_full_for_the_gather_halves_it_and_gives_the_same_sums(monkeypatch, rows_that_fit):
    """vLLM sizes the KV cache to the memory limit before the connector gets it: the gather body's temporaries (up
    to 256 MiB on CUDA) may not fit next to it. An out-of-memory error halves the batch until it fits and keeps it
    that size; where not even one row's temporaries fit, the rows are reduced in place. The sums never change."""
    views, offsets = pages_of((4096, 1536), (0, 8), blocks=24)
    segments = [[0, 1]]
    ids = [3, 17, 0, 23, 9, 11, 4, 5, 20, 1, 2, 8, 13]
    want = reference(views, segments, offsets, 0, ids)
    real, gathered = torch.Tensor.index_select, []

    def index_select(self, dim, index):
        gathered.append(int(index.numel()))
        if index.numel() > rows_that_fit:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(self, dim, index)

    summer = BlockChecksummer(views, segments, offsets, batch_bytes=16 * 4096)
    monkeypatch.setattr(torch.Tensor, "index_select", index_select)
    got = summer.compute(0, ids, method="gather").tolist()
    assert got == want
    if rows_that_fit:
        assert max(g for g in gathered if g <= rows_that_fit) == rows_that_fit  # halved to what fits, no further
        assert summer.batch_bytes // 4096 <= rows_that_fit  # and kept there for the next call
        gathered.clear()
        assert summer.compute(0, ids[:4], method="gather").tolist() == want[:4]
        assert all(g <= rows_that_fit for g in gathered)
    else:
        assert all(g > 0 for g in gathered) and summer.batch_bytes <= 4096  # down to one row, then in place
