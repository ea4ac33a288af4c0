"""The compiled host backend (vLLM's CPU-backend data path) against the reference copier, byte for byte.

Every store path this CPU has (memcpy, SSE2, AVX2, AVX-512 streaming) is run on page sizes around the streaming
threshold and the vector widths, on rows whose start is deliberately misaligned, and the whole backing buffers
(pages, the padding between rows, untouched rows) are compared, so a stray or missing byte anywhere fails.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from offload_connector.kernels import ReferenceCopier, make_copier
from offload_connector.kernels import host_copy
from offload_connector.kernels.host_copy import HostCopier, HostCopyUnavailable

ISAS_HERE = host_copy.ISAS[:host_copy.ISAS.index(host_copy.best_isa()) + 1]


def _strided(rows: int, page: int, pad: int, offset: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(backing buffer, (rows, page) view starting `offset` bytes in, row stride page + pad)."""
    base = torch.randint(0, 256, (offset + rows * (page + pad),), dtype=torch.uint8, generator=gen)
    view = base[offset:].view(rows, page + pad)[:, :page]
    return base, view


def _pair(pages, dev_rows, host_rows, gen, pads=(0, 24), offsets=(0, 3)):
    """Device-side and host-side tensors for each page size (one group per page size); returns backing buffers."""
    dev_b, dev, host_b, host, segs = [], [], [], [], []
    for g, page in enumerate(pages):
        b, v = _strided(dev_rows, page, pads[g % len(pads)], offsets[g % len(offsets)], gen)
        dev_b.append(b), dev.append(v)
        b, v = _strided(host_rows, page, pads[(g + 1) % len(pads)] + 8, offsets[(g + 1) % len(offsets)], gen)
        host_b.append(b), host.append(v)
        segs.append([g])
    return dev_b, dev, host_b, host, segs


def _views_of(bases, like):
    out = []
    for b, v in zip(bases, like):
        off = v.storage_offset()
        rows, page, stride = v.shape[0], v.shape[1], v.stride(0)
        out.append(b[off:off + rows * stride].view(rows, stride)[:, :page])
    return out


PAGES = (1, 63, 64, 255, 256, 257, 1000, 4096 + 13, 16384)


@pytest.mark.parametrize("isa", ISAS_HERE)
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_every_isa_matches_reference_on_whole_buffers(isa, direction):
    gen = torch.Generator().manual_seed(11)
    dev_b, dev, host_b, host, segs = _pair(PAGES, dev_rows=9, host_rows=7, gen=gen)
    rng = np.random.default_rng(5)
    ids = []
    for g in range(len(PAGES)):
        n = int(rng.integers(0, 7))  # 0 = a group with nothing to move this call
        ids.append((rng.permutation(7)[:n], rng.permutation(9)[:n]) if n else None)
    ref_dev_b, ref_host_b = [b.clone() for b in dev_b], [b.clone() for b in host_b]
    ReferenceCopier(_views_of(ref_dev_b, dev), _views_of(ref_host_b, host), segs).copy(direction, ids)
    c = HostCopier(dev, host, segs, isa=isa)
    assert c.isa == isa and c.name == "host"
    assert c.copy(direction, ids).query()
    for g, (a, e) in enumerate(zip(dev_b + host_b, ref_dev_b + ref_host_b)):
        assert torch.equal(a, e), f"buffer {g} (page {PAGES[g % len(PAGES)]}) differs from the reference"


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_groups_of_several_tensors_block_major(direction):
    """Groups of several tensors (the C call walks block by block across them), with mixed page sizes, rows that
    start misaligned, and a zero-byte tensor in a group."""
    gen = torch.Generator().manual_seed(21)
    pages = (4096, 4096, 300, 16384, 0, 520)
    dev_b, dev, host_b, host, _ = _pair(pages, dev_rows=11, host_rows=9, gen=gen, pads=(0, 40, 8), offsets=(0, 1, 7))
    segs = [[0, 1, 2], [3, 4, 5]]
    rng = np.random.default_rng(9)
    ids = [(rng.permutation(9)[:5], rng.permutation(11)[:5]), (rng.permutation(9)[:8], rng.permutation(11)[:8])]
    ref_dev_b, ref_host_b = [b.clone() for b in dev_b], [b.clone() for b in host_b]
    ReferenceCopier(_views_of(ref_dev_b, dev), _views_of(ref_host_b, host), segs).copy(direction, ids)
    HostCopier(dev, host, segs).copy(direction, ids)
    for t, (a, e) in enumerate(zip(dev_b + host_b, ref_dev_b + ref_host_b)):
        assert torch.equal(a, e), f"buffer {t} differs from the reference"


def test_repeated_sources_and_large_random_gather():
    gen = torch.Generator().manual_seed(3)
    dev_b, dev, host_b, host, segs = _pair((65536, 20000), dev_rows=40, host_rows=30, gen=gen, offsets=(0, 5))
    rng = np.random.default_rng(8)
    for direction in ("h2d", "d2h"):
        src_rows, dst_rows = (30, 40) if direction == "h2d" else (40, 30)
        n = 25
        src = rng.integers(0, src_rows, n)  # sources may repeat
        dst = rng.permutation(dst_rows)[:n]
        ids = [(src, dst) if direction == "h2d" else (dst, src)] * 2
        ref_dev_b, ref_host_b = [b.clone() for b in dev_b], [b.clone() for b in host_b]
        ReferenceCopier(_views_of(ref_dev_b, dev), _views_of(ref_host_b, host), segs).copy(direction, ids)
        HostCopier(dev, host, segs).copy(direction, ids)
        for a, e in zip(dev_b + host_b, ref_dev_b + ref_host_b):
            assert torch.equal(a, e)


def test_bad_ids_are_refused_before_any_byte_moves():
    gen = torch.Generator().manual_seed(4)
    dev_b, dev, host_b, host, segs = _pair((4096,), dev_rows=4, host_rows=4, gen=gen)
    before = [b.clone() for b in dev_b + host_b]
    c = HostCopier(dev, host, segs)
    with pytest.raises(ValueError, match="accepted range 0..3"):
        c.copy("h2d", [(np.array([0, 4]), np.array([1, 2]))])
    with pytest.raises(ValueError, match="destinations must be unique"):
        c.copy("h2d", [(np.array([0, 1]), np.array([2, 2]))])
    assert all(torch.equal(a, b) for a, b in zip(dev_b + host_b, before))


def test_isa_choice_is_validated():
    dev = [torch.zeros((2, 64), dtype=torch.uint8)]
    host = [torch.zeros((2, 64), dtype=torch.uint8)]
    with pytest.raises(ValueError, match=r"isa 'neon' is not one of \('memcpy', 'sse2', 'avx2', 'avx512'\)"):
        HostCopier(dev, host, [[0]], isa="neon")
    if len(ISAS_HERE) < len(host_copy.ISAS):
        with pytest.raises(ValueError, match="not supported by this CPU"):
            HostCopier(dev, host, [[0]], isa=host_copy.ISAS[-1])


def test_library_is_cached_by_source_and_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv(host_copy.ENV_CACHE_DIR, str(tmp_path))
    path = host_copy.library_path()
    assert path.parent == tmp_path / "host_copy" and not path.exists()
    host_copy.load_library()
    assert path.exists()
    stamp = path.stat().st_mtime_ns
    host_copy._loaded.clear()  # a new process: finds the cached file, does not compile again
    host_copy.load_library()
    assert path.stat().st_mtime_ns == stamp
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary files left behind


def test_an_unwritable_cache_dir_builds_in_a_temp_dir(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv(host_copy.ENV_CACHE_DIR, str(blocker))  # mkdir of not-a-dir/host_copy fails
    host_copy._loaded.clear()
    lib = host_copy.load_library()
    assert lib.oc_best_isa() in range(len(host_copy.ISAS))
    assert not host_copy.library_path().exists()


def test_without_a_compiler_auto_falls_back_and_host_is_a_clear_error(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(host_copy.ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.setenv("CC", "no-such-cc-offload")
    dev = [torch.zeros((2, 64), dtype=torch.uint8)]
    host = [torch.zeros((2, 64), dtype=torch.uint8)]
    with caplog.at_level("WARNING", logger="vllm.offload_connector.kernels"):
        c = make_copier("auto", dev, host, [[0]], device=torch.device("cpu"))
    assert isinstance(c, ReferenceCopier)
    assert "compiled host copy unavailable" in caplog.text and "no-such-cc-offload" in caplog.text
    with pytest.raises(HostCopyUnavailable, match="no C compiler: 'no-such-cc-offload' not found"):
        make_copier("host", dev, host, [[0]], device=torch.device("cpu"))


def test_a_compiler_that_fails_is_reported_with_its_output(tmp_path, monkeypatch):
    monkeypatch.setenv(host_copy.ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.setenv("CC", "cc -DOC_BROKEN=1 -include /nonexistent/oc.h")
    with pytest.raises(HostCopyUnavailable, match=r"failed on host_copy.c \(exit [1-9]"):
        host_copy.load_library()
    assert not any((tmp_path / "host_copy").iterdir())


def test_host_backend_refuses_a_cuda_device():
    dev = [torch.zeros((2, 64), dtype=torch.uint8)]
    host = [torch.zeros((2, 64), dtype=torch.uint8)]
    with pytest.raises(RuntimeError, match=r"backend 'host' copies between two host buffers .* device is cuda:0"):
        make_copier("host", dev, host, [[0]], device=torch.device("cuda:0"))
