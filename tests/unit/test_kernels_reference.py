"""The reference copier (the CPU backend's data path) against a per-page Python oracle, byte for byte."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from offload_connector.kernels import ReferenceCopier, allocate_host_tier, make_copier
from offload_connector.kernels.api import normalize_ids

SENTINEL = 0xA5


def _pages(rows: int, page: int, pad: int, gen: torch.Generator, fill: int | None = None) -> torch.Tensor:
    """A (rows, page) uint8 view whose row stride is page + pad (vLLM's strided page views)."""
    base = torch.empty((rows, page + pad), dtype=torch.uint8)
    if fill is None:
        base.copy_(torch.randint(0, 256, base.shape, dtype=torch.uint8, generator=gen))
    else:
        base.fill_(fill)
    return base[:, :page]


def oracle(direction, device_pages, host_pages, segments, ids):
    """Expected destination tensors after the copy, built one page at a time from clones."""
    dst = [t.clone() for t in (device_pages if direction == "h2d" else host_pages)]
    src = host_pages if direction == "h2d" else device_pages
    for g, pair in enumerate(ids):
        if pair is None:
            continue
        host_ids, dev_ids = pair
        for t in segments[g]:
            for h, d in zip(host_ids.tolist(), dev_ids.tolist()):
                if direction == "h2d":
                    dst[t][d] = src[t][h]
                else:
                    dst[t][h] = src[t][d]
    return dst


def _layout(gen, pages=(96, 40), tensors=(3, 2), dev_rows=12, host_rows=10, pad=16, sentinel_side=None):
    """Two groups with different page sizes; tensors of group 0 come first."""
    dev, host, segs, t = [], [], [], 0
    for page, n in zip(pages, tensors):
        seg = []
        for _ in range(n):
            dev.append(_pages(dev_rows, page, pad, gen, SENTINEL if sentinel_side == "dev" else None))
            host.append(_pages(host_rows, page, pad + 8, gen, SENTINEL if sentinel_side == "host" else None))
            seg.append(t)
            t += 1
        segs.append(seg)
    return dev, host, segs


def _check(direction, dev, host, segs, ids):
    expected = oracle(direction, dev, host, segs, ids)
    src_before = [t.clone() for t in (host if direction == "h2d" else dev)]
    ReferenceCopier(dev, host, segs).copy(direction, ids).wait()
    actual = dev if direction == "h2d" else host
    for t, (a, e) in enumerate(zip(actual, expected)):
        assert torch.equal(a, e), f"tensor {t} differs from the oracle"
    for a, b in zip(host if direction == "h2d" else dev, src_before):
        assert torch.equal(a, b), "the source changed"


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_matches_oracle_two_segments_strided(direction):
    gen = torch.Generator().manual_seed(1)
    dev, host, segs = _layout(gen, sentinel_side="dev" if direction == "h2d" else "host")
    rng = np.random.default_rng(2)
    ids = [(rng.permutation(10)[:6], rng.permutation(12)[:6]), (rng.permutation(10)[:3], rng.permutation(12)[:3])]
    _check(direction, dev, host, segs, ids)
    # Untouched destination pages keep the sentinel, and the padding between pages is never written.
    dst = dev if direction == "h2d" else host
    touched = set(ids[0][1 if direction == "h2d" else 0].tolist())
    for r in range(dst[0].shape[0]):
        if r not in touched:
            assert bool((dst[0][r] == SENTINEL).all())
    full = dst[0].as_strided((dst[0].shape[0], dst[0].stride(0)), (dst[0].stride(0), 1))
    assert bool((full[:, dst[0].shape[1]:] == SENTINEL).all())


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_repeated_sources(direction):
    gen = torch.Generator().manual_seed(3)
    dev, host, segs = _layout(gen)
    if direction == "h2d":
        ids = [(np.array([4, 4, 4, 1]), np.array([0, 5, 11, 2])), None]
    else:
        ids = [(np.array([0, 5, 9, 2]), np.array([7, 7, 7, 3])), None]
    _check(direction, dev, host, segs, ids)


@pytest.mark.parametrize("n", [0, 1])
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_zero_and_one_block(direction, n):
    gen = torch.Generator().manual_seed(4)
    dev, host, segs = _layout(gen)
    ids = [(np.arange(n, dtype=np.int64) + 3, np.arange(n, dtype=np.int64) + 7), None]
    before = [t.clone() for t in dev + host]
    _check(direction, dev, host, segs, ids)
    if n == 0:
        assert all(torch.equal(a, b) for a, b in zip(dev + host, before))


def test_round_trip_d2h_then_h2d():
    gen = torch.Generator().manual_seed(5)
    dev, host, segs = _layout(gen)
    original = [t.clone() for t in dev]
    c = ReferenceCopier(dev, host, segs)
    ids = [(np.array([9, 0, 4]), np.array([1, 2, 3])), (np.array([5]), np.array([11]))]
    c.copy("d2h", ids).wait()
    for t in dev:
        t.fill_(0)
    c.copy("h2d", ids).wait()
    for t, seg in enumerate(segs):
        rows = ids[t][1].tolist()
        for ti in seg:
            for r in rows:
                assert torch.equal(dev[ti][r], original[ti][r])


def test_host_tier_views_block_first():
    """Per-tensor views carved out of one block-first arena (the connector's host layout) copy correctly."""
    gen = torch.Generator().manual_seed(6)
    pages = [64, 64, 32]
    tier = allocate_host_tier(8, sum(pages), pin=False)
    assert not tier.pinned and tier.tensor.shape == (8, sum(pages))
    tier.tensor.fill_(SENTINEL)
    host, off = [], 0
    for p in pages:
        host.append(tier.tensor[:, off:off + p])
        off += p
    dev = [_pages(6, p, 0, gen) for p in pages]
    segs = [[0, 1], [2]]
    ids = [(np.array([7, 0]), np.array([5, 1])), (np.array([3]), np.array([0]))]
    _check("d2h", dev, host, segs, ids)
    assert bool((tier.tensor[[1, 2, 4, 5, 6]] == SENTINEL).all())
    tier.close()


def test_random_fuzz_both_directions():
    rng = np.random.default_rng(7)
    for trial in range(20):
        gen = torch.Generator().manual_seed(100 + trial)
        ngroups = int(rng.integers(1, 4))
        pages = tuple(int(x) for x in rng.choice([1, 3, 16, 48, 100], ngroups))
        tensors = tuple(int(x) for x in rng.integers(1, 4, ngroups))
        dev, host, segs = _layout(gen, pages, tensors, dev_rows=9, host_rows=7, pad=int(rng.integers(0, 9)))
        direction = "h2d" if trial % 2 else "d2h"
        ids = []
        for _ in range(ngroups):
            n = int(rng.integers(0, 7))
            if direction == "h2d":
                ids.append((rng.integers(0, 7, n), rng.permutation(9)[:n]))
            else:
                ids.append((rng.permutation(7)[:n], rng.integers(0, 9, n)))
        _check(direction, dev, host, segs, ids)


def test_make_copier_cpu_auto_and_reference():
    gen = torch.Generator().manual_seed(8)
    dev, host, segs = _layout(gen)
    for backend, name in (("auto", "host"), ("reference", "reference"), ("host", "host")):
        c = make_copier(backend, dev, host, segs, device=torch.device("cpu"))
        assert c.name == name and isinstance(c, ReferenceCopier) == (name == "reference")
        done = c.copy("h2d", [None, None])
        assert done.query()


# --- validation -----------------------------------------------------------------------------------------------

def _small():
    gen = torch.Generator().manual_seed(9)
    return _layout(gen)


def test_validation_errors_name_the_problem():
    dev, host, segs = _small()
    c = ReferenceCopier(dev, host, segs)
    with pytest.raises(ValueError, match="direction 'up'"):
        c.copy("up", [None, None])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one per KV cache group expected"):
        c.copy("h2d", [None])
    with pytest.raises(ValueError, match=r"ids\[0\]: 2 host_slot_ids but 1 device_block_ids"):
        c.copy("h2d", [(np.array([1, 2]), np.array([1])), None])
    with pytest.raises(ValueError, match=r"host_slot_ids contains 10; accepted range 0..9"):
        c.copy("h2d", [(np.array([10]), np.array([1])), None])
    with pytest.raises(ValueError, match=r"device_block_ids contains -1"):
        c.copy("d2h", [(np.array([1]), np.array([-1])), None])
    with pytest.raises(ValueError, match=r"device_block_ids \(the h2d destination\) repeats block 3"):
        c.copy("h2d", [(np.array([1, 2]), np.array([3, 3])), None])
    with pytest.raises(ValueError, match=r"host_slot_ids \(the d2h destination\) repeats block 4"):
        c.copy("d2h", [None, (np.array([4, 4]), np.array([0, 1]))])
    with pytest.raises(ValueError, match="must be integers"):
        c.copy("d2h", [None, (np.array([0.5]), np.array([0]))])
    # A rejected call writes nothing.
    before = [t.clone() for t in dev + host]
    with pytest.raises(ValueError):
        c.copy("h2d", [(np.array([1]), np.array([1])), (np.array([1, 1]), np.array([2, 2]))])
    assert all(torch.equal(a, b) for a, b in zip(dev + host, before))


def test_layout_validation():
    dev, host, segs = _small()
    with pytest.raises(ValueError, match="device_pages has 5 tensors but host_pages has 4"):
        ReferenceCopier(dev, host[:4], segs)
    with pytest.raises(ValueError, match="segments must be disjoint"):
        ReferenceCopier(dev, host, [[0, 1], [1, 2]])
    with pytest.raises(ValueError, match=r"segments\[1\] names tensor 7; accepted: 0..4"):
        ReferenceCopier(dev, host, [[0], [7]])
    with pytest.raises(ValueError, match="2-D uint8"):
        ReferenceCopier([dev[0].view(torch.int8)], [host[0]], [[0]])
    with pytest.raises(ValueError, match="device page_bytes 96 != host page_bytes 40"):
        ReferenceCopier([dev[0]], [host[3]], [[0]])
    with pytest.raises(ValueError, match="rows must be contiguous"):
        ReferenceCopier([dev[0][:, ::2]], [host[0][:, ::2]], [[0]])


def test_backend_name_validation():
    dev, host, segs = _small()
    with pytest.raises(ValueError, match=r"backend 'fast' is not one of \('auto', 'reference', 'kernel', 'batch', "
                                         r"'per_page', 'host'\)"):
        make_copier("fast", dev, host, segs, device=torch.device("cpu"))


def test_normalize_ids_accepts_lists_and_none():
    dev, host, segs = _small()
    c = ReferenceCopier(dev, host, segs)
    out = normalize_ids("h2d", [([1, 2], [3, 4]), ([], [])], c.layouts, c.segments)
    assert out[1] is None and out[0][0].dtype == np.int64
