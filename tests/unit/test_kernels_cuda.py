"""CUDA backends without a GPU (emulated work split, NVRTC compile, selection with no driver) and, on a GPU,
every backend against the reference byte for byte."""
from __future__ import annotations

import importlib
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from offload_connector.kernels import Completion, ReferenceCopier, allocate_host_tier, make_copier, workplan
from offload_connector.kernels.select import BACKENDS, SM_MARGIN, DirectionalCopier, parse_forced, pick_fastest

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels"
CU_FILES = sorted(KERNEL_DIR.glob("*.cu"))
HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


# --- numpy emulator of the kernel's work decomposition ------------------------------------------------------------

def _emulated_case(rng, pages, tensors, dev_rows, host_rows, n_per_group, direction, chunk, width, pad):
    """Flat byte buffers standing in for device and host memory, with tensors laid out back to back."""
    dev_bases, host_bases, dev_strides, host_strides, page_bytes, segs = [], [], [], [], [], []
    dev_off = host_off = 0
    t = 0
    for page, n_t in zip(pages, tensors):
        seg = []
        for _ in range(n_t):
            ds, hs = page + pad, page + 2 * pad
            dev_bases.append(dev_off); dev_strides.append(ds)
            host_bases.append(host_off); host_strides.append(hs)
            page_bytes.append(page)
            dev_off += ds * dev_rows
            host_off += hs * host_rows
            seg.append(t)
            t += 1
        segs.append(seg)
    dev_mem = rng.integers(0, 256, dev_off, dtype=np.uint8)
    host_mem = rng.integers(0, 256, host_off, dtype=np.uint8)
    ids = []
    for n in n_per_group:
        if direction == "h2d":
            ids.append((rng.integers(0, host_rows, n).astype(np.int64), rng.permutation(dev_rows)[:n].astype(np.int64)))
        else:
            ids.append((rng.permutation(host_rows)[:n].astype(np.int64), rng.integers(0, dev_rows, n).astype(np.int64)))
    table = workplan.tensor_table(direction, dev_bases, dev_strides, host_bases, host_strides, page_bytes)
    seg_flat, begins = workplan.segment_tensors(segs)
    plan = workplan.pack_call(direction, [p if p[0].size else None for p in ids], segs, begins, page_bytes, chunk)
    src_mem, dst_mem = (host_mem, dev_mem) if direction == "h2d" else (dev_mem, host_mem)
    expected = dst_mem.copy()
    expected_writes = np.zeros(dst_mem.size, dtype=np.int32)
    for g, (h_ids, d_ids) in enumerate(ids):
        for ti in segs[g]:
            for h, d in zip(h_ids.tolist(), d_ids.tolist()):
                s_row, d_row = (h, d) if direction == "h2d" else (d, h)
                sb = table[ti, 0] + s_row * table[ti, 1]
                db = table[ti, 2] + d_row * table[ti, 3]
                expected[db:db + page_bytes[ti]] = src_mem[sb:sb + page_bytes[ti]]
                expected_writes[db:db + page_bytes[ti]] += 1
    writes = workplan.emulate(plan, table, seg_flat, src_mem, dst_mem, chunk, width, num_warps=7)
    return dst_mem, expected, writes, expected_writes, plan


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("width,pages,pad", [(16, (160, 96), 32), (8, (72, 40), 8), (4, (52, 12), 4),
                                             (1, (37, 5), 3)])
def test_emulator_every_destination_byte_written_once(direction, width, pages, pad):
    rng = np.random.default_rng(width)
    dst_mem, expected, writes, expected_writes, plan = _emulated_case(
        rng, pages, (3, 2), dev_rows=9, host_rows=11, n_per_group=(5, 3), direction=direction, chunk=64,
        width=width, pad=pad)
    assert workplan.vector_width([pages[0], pages[1], pages[0] + pad, pages[1] + pad, pages[0] + 2 * pad]) >= width
    assert plan.num_segs == 2 and plan.total_items > 0
    np.testing.assert_array_equal(writes, expected_writes)  # copied bytes exactly once, the rest never
    assert set(np.unique(writes).tolist()) <= {0, 1}
    np.testing.assert_array_equal(dst_mem, expected)


def test_emulator_tail_chunks_mixed_pages_and_empty_groups():
    """A group whose tensors differ in page size (empty trailing chunks), an empty group, N = 1."""
    rng = np.random.default_rng(11)
    dev_bases, dev_strides, host_bases, host_strides = [0, 4096, 8192], [256, 128, 64], [0, 2048, 4096], [256, 128, 64]
    page_bytes = [208, 112, 48]
    segs = [[0, 1], [], [2]]
    ids = [(np.array([3], dtype=np.int64), np.array([7], dtype=np.int64)), None,
           (np.array([0, 5], dtype=np.int64), np.array([1, 2], dtype=np.int64))]
    table = workplan.tensor_table("h2d", dev_bases, dev_strides, host_bases, host_strides, page_bytes)
    seg_flat, begins = workplan.segment_tensors(segs)
    plan = workplan.pack_call("h2d", ids, segs, begins, page_bytes, 96)
    # group 0: 1 page x 2 tensors x ceil(208 / 96) = 3 chunks; group 2: 2 pages x 1 tensor x 1 chunk
    assert plan.num_segs == 2 and plan.total_items == 6 + 2
    src = rng.integers(0, 256, 8192 + 64 * 16, dtype=np.uint8)
    dst = np.zeros(8192 + 64 * 16, dtype=np.uint8)
    writes = workplan.emulate(plan, table, seg_flat, src, dst, 96, 16, num_warps=3)
    assert int(writes.sum()) == 208 + 112 + 2 * 48 and int(writes.max()) == 1
    np.testing.assert_array_equal(dst[7 * 256:7 * 256 + 208], src[3 * 256:3 * 256 + 208])
    np.testing.assert_array_equal(dst[4096 + 7 * 128:4096 + 7 * 128 + 112], src[2048 + 3 * 128:2048 + 3 * 128 + 112])
    np.testing.assert_array_equal(dst[8192 + 64:8192 + 64 + 48], src[4096:4096 + 48])
    np.testing.assert_array_equal(dst[8192 + 128:8192 + 128 + 48], src[4096 + 5 * 64:4096 + 5 * 64 + 48])


def test_pack_call_empty_and_grid():
    plan = workplan.pack_call("h2d", [None], [[0]], [0], [64], 16)
    assert plan.total_items == 0 and plan.buffer.size == 0
    assert workplan.grid_size(1, 16) == 1
    assert workplan.grid_size(10_000, 16) == 16
    assert workplan.vector_width([4096, 64, 24]) == 8 and workplan.vector_width([3]) == 1


# --- NVRTC and source hygiene ---------------------------------------------------------------------------------

def test_cu_sources_exist():
    assert CU_FILES, "no .cu sources under kernels/"


# The options CuPy's RawModule adds on its own (cupy/cuda/compiler.py), so the check matches the real loader.
CUPY_FLAGS = ["-ftz=true", "--device-as-default-execution-space"]


@pytest.mark.parametrize("cu", CU_FILES, ids=lambda p: p.name)
@pytest.mark.parametrize("arch", ["compute_80", "sm_90", "sm_100"])
@pytest.mark.parametrize("flags", [[], CUPY_FLAGS], ids=["plain", "cupy-flags"])
def test_nvrtc_compiles(cu, arch, flags):
    cupy = pytest.importorskip("cupy", reason="CuPy is installed only in the CUDA (vllm033) environment")
    nvrtc = cupy.cuda.nvrtc
    prog = nvrtc.createProgram(cu.read_text(), cu.name, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [f"-arch={arch}", *flags])  # default dialect, as the loader
        except Exception as exc:  # noqa: BLE001 - show the compiler log, not just the error code
            pytest.fail(f"NVRTC failed for {cu.name} ({arch}): {exc}\n{nvrtc.getProgramLog(prog)}")
        ptx = nvrtc.getPTX(prog)
        for entry in ("kv_gather_scatter_v16", "kv_gather_scatter_v8", "kv_gather_scatter_v4",
                      "kv_gather_scatter_v1"):
            assert entry.encode() in (ptx if isinstance(ptx, bytes) else ptx.encode())
        text = ptx.decode() if isinstance(ptx, bytes) else ptx
        # The fast path really is 16-byte streaming accesses (what the design relies on for PCIe efficiency).
        assert "ld.global.cs.v4.u32" in text and "st.global.cs.v4.u32" in text
    finally:
        nvrtc.destroyProgram(prog)


# --- import and selection with no driver ----------------------------------------------------------------------

def test_import_needs_no_gpu_cupy_or_driver():
    """Importing the package (in a fresh interpreter) loads neither CuPy nor the CUDA driver bindings."""
    # (torch's CUDA build itself imports cuda.bindings, so only CuPy and our driver calls are checked.)
    code = ("import sys, offload_connector.kernels as k; "
            "import offload_connector.kernels.cupy_kernel, offload_connector.kernels.batch_dma, "
            "offload_connector.kernels.per_page; assert 'cupy' not in sys.modules, 'cupy imported'; "
            "sched = [m for m in sys.modules if m.startswith('offload_connector.scheduler') or "
            "m.startswith('vllm.v1.core.sched')]; assert not sched, sched; "
            "from offload_connector.kernels import cuda_driver as d; "
            "assert d.batch_memcpy.cache_info().currsize == 0; print('ok')")
    _prints_ok_in_a_fresh_interpreter(code)


def _prints_ok_in_a_fresh_interpreter(code: str, *first_on_path: Path) -> None:
    """Runs `code` in a new Python with no GPU visible and only this checkout (after `first_on_path`) on its path."""
    root = Path(__file__).resolve().parents[2]
    path = ":".join(str(p) for p in (*first_on_path, root))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                         env={"PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_gpu_check_modules_import_without_vllm(tmp_path):
    """scripts/gpu-check runs on a GPU machine that has torch and CUDA but no vLLM: the kernels, the transfer engine,
    its jobs and the checksums must import there (the first H200 run failed one test on `import vllm` in metadata)."""
    blocker = tmp_path / "vllm"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('no vllm on the GPU machine')\n")
    code = ("import sys; from offload_connector.kernels import make_copier, allocate_host_tier; "
            "from offload_connector.transfer_jobs import TransferJob; "
            "from offload_connector.worker.transfers import TransferEngine; "
            "from offload_connector.worker.checksum import SlotChecksums; "
            "TransferJob(1, 'a', ((3, 4),), ((0, 1),)); assert 'vllm' not in sys.modules; print('ok')")
    _prints_ok_in_a_fresh_interpreter(code, tmp_path)


def _cpu_layout():
    dev = [torch.zeros((4, 32), dtype=torch.uint8)]
    host = [torch.zeros((4, 32), dtype=torch.uint8)]
    return dev, host, [[0]]


def test_auto_on_cpu_is_the_host_backend():
    dev, host, segs = _cpu_layout()
    assert make_copier("auto", dev, host, segs, device=torch.device("cpu")).name == "host"


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU error path")
@pytest.mark.parametrize("backend", ["kernel", "batch", "per_page"])
def test_forcing_a_cuda_backend_without_gpu_is_a_clear_error(backend):
    dev, host, segs = _cpu_layout()
    with pytest.raises(RuntimeError, match=f"backend '{backend}' needs a CUDA device, but device is cpu"):
        make_copier(backend, dev, host, segs, device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match=f"backend '{backend}' needs a CUDA device, but torch sees none"):
        make_copier(backend, dev, host, segs, device=torch.device("cuda:0"))


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU path")
def test_kernel_copier_refuses_cpu_pages_directly():
    from offload_connector.kernels.cupy_kernel import KernelCopier
    dev, host, segs = _cpu_layout()
    with pytest.raises(RuntimeError, match="needs CUDA device pages"):
        KernelCopier(dev, host, segs)


def test_pin_without_gpu_falls_back_with_warning(caplog):
    if HAS_CUDA:
        pytest.skip("checks the no-GPU fallback")
    with caplog.at_level(logging.WARNING, logger="vllm.offload_connector.kernels"):
        tier = allocate_host_tier(3, 4096, pin=True)
    assert not tier.pinned and tier.tensor.shape == (3, 4096) and tier.tensor.dtype == torch.uint8
    assert any("using pageable memory" in r.message for r in caplog.records)
    assert tier.tensor.data_ptr() % 4096 == 0  # mmap arena: page aligned, so 16-byte vector accesses apply
    tier.tensor.fill_(7)
    tier.close()
    assert int(tier.tensor.sum()) == 3 * 4096 * 7


def test_host_tier_argument_validation():
    with pytest.raises(ValueError, match="num_slots must be a positive int, got 0"):
        allocate_host_tier(0, 16, pin=False)
    with pytest.raises(ValueError, match="slot_bytes must be a positive int, got -1"):
        allocate_host_tier(2, -1, pin=False)


def test_forced_backend_parsing_and_tie_break():
    assert parse_forced("batch") == {"h2d": "batch", "d2h": "batch"}
    assert parse_forced("h2d=kernel, d2h=batch") == {"h2d": "kernel", "d2h": "batch"}
    with pytest.raises(ValueError, match="accepted"):
        parse_forced("fastest")
    with pytest.raises(ValueError, match=r"names no backend for \['d2h'\]"):
        parse_forced("h2d=kernel")
    assert pick_fastest({"kernel": 1.0, "batch": 1.04}, margin=0.05) == "batch"
    assert pick_fastest({"kernel": 1.0, "batch": 1.2}, margin=0.05) == "kernel"
    assert pick_fastest({}, margin=0.05) == "reference"
    # The margins the calibration uses: DMA keeps stores unless the kernel takes under half its time, loads unless
    # under 1/1.25 (H200: a 1.2x faster store kernel cost a matmul beside it 40 %).
    assert pick_fastest({"kernel": 1.0, "batch": 1.2}, margin=SM_MARGIN["d2h"]) == "batch"
    assert pick_fastest({"kernel": 1.0, "batch": 1.9}, margin=SM_MARGIN["d2h"]) == "batch"
    assert pick_fastest({"kernel": 1.0, "batch": 2.1}, margin=SM_MARGIN["d2h"]) == "kernel"
    assert pick_fastest({"kernel": 1.0, "batch": 1.2}, margin=SM_MARGIN["h2d"]) == "batch"
    assert pick_fastest({"kernel": 1.0, "batch": 1.3}, margin=SM_MARGIN["h2d"]) == "kernel"
    assert pick_fastest({"kernel": 1.0, "per_page": 1.9}, margin=SM_MARGIN["d2h"]) == "kernel"
    assert BACKENDS == ("auto", "reference", "kernel", "batch", "per_page", "host")


def test_driver_helpers_fail_cleanly_without_driver():
    if HAS_CUDA:
        pytest.skip("checks the no-driver path")
    drv = importlib.import_module("offload_connector.kernels.cuda_driver")
    drv.batch_memcpy.cache_clear()
    with pytest.raises(drv.DriverError):
        drv.batch_memcpy()


# --- on a GPU: every backend against the reference ------------------------------------------------------------

def _gpu_layout(seed, pages=(4096, 1040, 96), tensors=(3, 2, 1), dev_rows=24, host_rows=20, pad=512):
    gen = torch.Generator().manual_seed(seed)
    dev, host, segs, tiers, t = [], [], [], [], 0
    for page, n in zip(pages, tensors):
        seg = []
        for _ in range(n):
            base = torch.randint(0, 256, (dev_rows, page + pad), dtype=torch.uint8, generator=gen).cuda()
            dev.append(base[:, :page])
            tier = allocate_host_tier(host_rows, page + pad, pin=True)
            assert tier.pinned
            tier.tensor.copy_(torch.randint(0, 256, (host_rows, page + pad), dtype=torch.uint8, generator=gen))
            tiers.append(tier)
            host.append(tier.tensor[:, :page])
            seg.append(t)
            t += 1
        segs.append(seg)
    return dev, host, segs, tiers


def _ids(rng, direction, n_per_group, dev_rows=24, host_rows=20):
    out = []
    for n in n_per_group:
        if direction == "h2d":
            out.append((rng.integers(0, host_rows, n), rng.permutation(dev_rows)[:n]))
        else:
            out.append((rng.permutation(host_rows)[:n], rng.integers(0, dev_rows, n)))
    return out


@gpu
@needs_gpu
@pytest.mark.parametrize("backend", ["kernel", "batch", "per_page", "auto"])
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_gpu_backend_matches_reference(backend, direction):
    for trial, counts in enumerate([(0, 0, 0), (1, 0, 1), (7, 3, 5), (20, 20, 20)]):
        rng = np.random.default_rng(trial)
        dev, host, segs, tiers = _gpu_layout(trial)
        ref_dev = [d.clone() for d in dev]
        ref_host = [h.clone() for h in host]
        ids = _ids(rng, direction, counts)
        ReferenceCopier([d for d in ref_dev], [h for h in ref_host], segs).copy(direction, ids).wait()
        copier = make_copier(backend, dev, host, segs, device=dev[0].device)
        stream = torch.cuda.Stream()
        done = copier.copy(direction, ids, stream)
        done.wait()
        assert done.query()
        for t in range(len(dev)):
            # Whole views compared: copied pages equal the reference, untouched pages unchanged.
            assert torch.equal(dev[t].cpu(), ref_dev[t].cpu()), f"{backend} {direction} trial {trial} tensor {t}"
            assert torch.equal(host[t], ref_host[t]), f"{backend} {direction} trial {trial} tensor {t}"
        copier.close()
        for tier in tiers:
            tier.close()


@gpu
@needs_gpu
@pytest.mark.parametrize("offset", [8, 4, 1])
def test_gpu_kernel_unaligned_widths(offset):
    """Bases/pages not 16-byte aligned pick the 8/4/1-byte kernels and still match."""
    gen = torch.Generator().manual_seed(offset)
    page = 1000 + offset
    dev_base = torch.randint(0, 256, (10, page + offset + 64), dtype=torch.uint8, generator=gen).cuda()
    tier = allocate_host_tier(10, page + offset + 64, pin=True)
    tier.tensor.copy_(torch.randint(0, 256, tuple(tier.tensor.shape), dtype=torch.uint8, generator=gen))
    dev = [dev_base[:, offset:offset + page]]
    host = [tier.tensor[:, offset:offset + page]]
    from offload_connector.kernels.cupy_kernel import KernelCopier
    k = KernelCopier(dev, host, [[0]])
    assert k.width == offset
    before = dev_base.clone()
    ids = [(np.array([3, 1, 4]), np.array([9, 2, 6]))]
    k.copy("h2d", ids).wait()
    expect = before.clone()
    for h, d in zip([3, 1, 4], [9, 2, 6]):
        expect[d, offset:offset + page] = tier.tensor[h, offset:offset + page].cuda()
    assert torch.equal(dev_base, expect)
    tier.close()


@gpu
@needs_gpu
def test_gpu_auto_is_directional_and_round_trips():
    dev, host, segs, tiers = _gpu_layout(42)
    copier = make_copier("auto", dev, host, segs, device=dev[0].device)
    assert isinstance(copier, DirectionalCopier)
    assert _round_trips(copier, dev, segs)
    for tier in tiers:
        tier.close()


def _round_trips(copier, dev, segs) -> bool:
    """Pages 0-4 of every tensor out to host slots 0-4 and back into device rows 3-7: equal to what they were."""
    original = [d.clone() for d in dev]
    ids = [(np.arange(5), np.arange(5) + 3)] * len(segs)
    copier.copy("d2h", ids).wait()
    for d in dev:
        d.zero_()
    copier.copy("h2d", ids).wait()
    return all(torch.equal(d[3:8], o[3:8]) for d, o in zip(dev, original))


@gpu
@needs_gpu
def test_gpu_batch_copies_on_the_legacy_default_stream():
    """cuMemcpyBatchAsync rejects the legacy default stream (CUresult 1 on an H200, when "auto" gave a default-stream
    caller this backend); the copier runs such a call on its own stream and keeps it in the caller's order."""
    dev, host, segs, tiers = _gpu_layout(44)
    copier = make_copier("batch", dev, host, segs, device=dev[0].device)
    assert torch.cuda.current_stream(dev[0].device).cuda_stream == 0
    assert _round_trips(copier, dev, segs)
    copier.close()
    for tier in tiers:
        tier.close()


@gpu
@needs_gpu
def test_gpu_auto_comes_up_on_a_nearly_full_device():
    """As under vLLM, which sizes the KV cache to the memory limit first: with 48 MiB left on the device the default
    calibration's scratch (2 x 256 of these 1 MiB blocks) shrinks or is skipped, and the copier it returns still
    copies exactly."""
    dev, host, segs, tiers = _gpu_layout(43, pages=(256 << 10,), tensors=(4,))
    torch.cuda.synchronize()
    free, _total = torch.cuda.mem_get_info()
    hog = torch.empty(max(free - (48 << 20), 0), dtype=torch.uint8, device=dev[0].device)
    try:
        copier = make_copier("auto", dev, host, segs, device=dev[0].device)
        assert _round_trips(copier, dev, segs)
        copier.close()
    finally:
        del hog
        torch.cuda.empty_cache()
        for tier in tiers:
            tier.close()


# --- "auto" selection logic, exercised on CPU with stand-in backends ----------------------------------------------

class _VirtualClock:
    """Calibration's timer in the stand-in tests: only the stand-ins' delays advance it, so which stand-in is faster
    does not depend on how busy the machine is (with real sleeps a loaded CI machine picked the slower one)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class _Slow(ReferenceCopier):
    delay = 0.0
    clock: _VirtualClock | None = None

    def _copy(self, direction, ids, stream):
        if self.clock is not None:
            self.clock.now += self.delay
        return super()._copy(direction, ids, stream)


def _standins(monkeypatch, delays: dict[str, float], broken: set[str] = frozenset(), unbuildable=frozenset()):
    from offload_connector.kernels import select
    clock = _VirtualClock()
    monkeypatch.setattr(select, "time", clock)

    def build(name, device_pages, host_pages, segments, device):
        if name in unbuildable:
            raise RuntimeError(f"{name} cannot start here")
        if name == "reference":
            return ReferenceCopier(device_pages, host_pages, segments)

        class Standin(_Slow):
            pass
        Standin.delay = delays.get(name, 0.0)
        Standin.clock = clock
        Standin.name = name
        c = Standin(device_pages, host_pages, segments)
        if name in broken:
            c._copy = lambda direction, ids, stream: Completion()  # claims success, copies nothing
        return c

    monkeypatch.setattr(select, "_build", build)
    return select


def test_calibration_picks_fastest_and_drops_wrong_backends(monkeypatch, caplog):
    select = _standins(monkeypatch, {"kernel": 0.0, "batch": 0.02, "per_page": 0.04}, broken={"kernel"})
    dev, host, segs = _cpu_layout()
    cfg = select.CalibrationConfig(max_bytes=1 << 16, max_blocks=8, repeats=2)
    with caplog.at_level(logging.WARNING, logger="vllm.offload_connector.kernels"):
        choice = select.calibrate(dev, segs, torch.device("cpu"), cfg)
    # kernel is fastest but copies nothing: dropped with a warning; batch beats per_page.
    assert choice == {"h2d": "batch", "d2h": "batch"}
    assert any("'kernel' failed during calibration" in r.message for r in caplog.records)
    select = _standins(monkeypatch, {"kernel": 0.0, "batch": 0.03, "per_page": 0.06})
    assert select.calibrate(dev, segs, torch.device("cpu"), cfg) == {"h2d": "kernel", "d2h": "kernel"}


def test_calibration_shrinks_its_scratch_when_the_device_is_full(monkeypatch, caplog):
    """vLLM sizes the KV cache to the memory limit before the worker calibrates: scratch pages that do not fit are
    halved until they do, and with no room at all the calibration is skipped for DMA, never an error at start-up."""
    select = _standins(monkeypatch, {"kernel": 0.0, "batch": 0.03, "per_page": 0.06})
    dev, host, segs = _cpu_layout()
    cfg = select.CalibrationConfig(max_bytes=1 << 16, max_blocks=64, repeats=1)
    real_randint, rows = torch.randint, []

    def randint_within(limit):
        def randint(low, high, size, **kw):
            if kw.get("device") is not None:  # the device scratch, not the host fill
                rows.append(size[0])
                if size[0] > limit:
                    raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return real_randint(low, high, size, **kw)
        return randint

    monkeypatch.setattr(torch, "randint", randint_within(32))
    assert select.calibrate(dev, segs, torch.device("cpu"), cfg) == {"h2d": "kernel", "d2h": "kernel"}
    assert rows == [128, 64, 32]  # 2 x 64 blocks, halved twice
    rows.clear()
    monkeypatch.setattr(torch, "randint", randint_within(0))
    with caplog.at_level(logging.WARNING, logger="vllm.offload_connector.kernels"):
        choice = select.calibrate(dev, segs, torch.device("cpu"), cfg)
    assert choice == {"h2d": select.UNCALIBRATED, "d2h": select.UNCALIBRATED}
    assert rows == [128, 64, 32, 16] and any("no device memory" in r.message for r in caplog.records)


def test_auto_on_cuda_falls_back_when_the_choice_cannot_build(monkeypatch, caplog):
    select = _standins(monkeypatch, {}, unbuildable={"kernel"})
    monkeypatch.setattr(select, "calibrate", lambda *a, **k: {"h2d": "kernel", "d2h": "per_page"})
    monkeypatch.delenv(select.ENV_FORCE, raising=False)
    dev, host, segs = _cpu_layout()
    with caplog.at_level(logging.WARNING, logger="vllm.offload_connector.kernels"):
        c = select.make_copier("auto", dev, host, segs, device=torch.device("cuda:0"))
    assert isinstance(c, DirectionalCopier)
    assert c.per_direction["h2d"].name == "batch" and c.per_direction["d2h"].name == "per_page"
    assert any("'kernel' unavailable for h2d" in r.message for r in caplog.records)
    c.copy("h2d", [(np.array([1]), np.array([2]))]).wait()
    assert torch.equal(dev[0][2], host[0][1])


def test_auto_env_override_skips_calibration(monkeypatch):
    select = _standins(monkeypatch, {})
    monkeypatch.setattr(select, "calibrate", lambda *a, **k: pytest.fail("calibration must not run"))
    monkeypatch.setenv(select.ENV_FORCE, "h2d=per_page,d2h=kernel")
    dev, host, segs = _cpu_layout()
    c = select.make_copier("auto", dev, host, segs, device=torch.device("cuda:0"))
    assert c.name == "auto(h2d=per_page,d2h=kernel)"
    monkeypatch.setenv(select.ENV_FORCE, "warp")
    with pytest.raises(ValueError, match="OFFLOAD_CONNECTOR_COPY_BACKEND='warp'"):
        select.make_copier("auto", dev, host, segs, device=torch.device("cuda:0"))


# --- the DMA backends' descriptor math, executed with memmove on host memory --------------------------------------

@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_dma_descriptors_move_the_reference_bytes(direction):
    """The (dst, src, size) lists the batch and per-page backends hand the driver, replayed with memmove on CPU
    tensors, produce exactly the reference result (two groups, strided views, repeated sources)."""
    import ctypes

    from offload_connector.kernels.api import normalize_ids
    from offload_connector.kernels.descriptors import page_descriptors

    gen = torch.Generator().manual_seed(5)
    pages, n_tensors = (48, 20), (2, 3)
    dev, host, segs, t = [], [], [], 0
    for page, n in zip(pages, n_tensors):
        segs.append(list(range(t, t + n)))
        for _ in range(n):
            dev.append(torch.randint(0, 256, (9, page + 8), dtype=torch.uint8, generator=gen)[:, :page])
            host.append(torch.randint(0, 256, (7, page + 24), dtype=torch.uint8, generator=gen)[:, :page])
            t += 1
    rng = np.random.default_rng(3)
    if direction == "h2d":
        ids = [(rng.integers(0, 7, 5), rng.permutation(9)[:5]), (np.array([2, 2]), np.array([0, 8]))]
    else:
        ids = [(rng.permutation(7)[:5], rng.integers(0, 9, 5)), (np.array([6, 0]), np.array([3, 3]))]
    ref_dev, ref_host = [d.clone() for d in dev], [h.clone() for h in host]
    ReferenceCopier(ref_dev, ref_host, segs).copy(direction, ids).wait()
    ref = ReferenceCopier(dev, host, segs)
    norm = normalize_ids(direction, ids, ref.layouts, ref.segments)
    dsts, srcs, sizes = page_descriptors(direction, norm, dev, host, segs)
    assert dsts.size == 5 * 2 + 2 * 3 and dsts.dtype == np.uint64
    for d, s, n in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
        ctypes.memmove(d, s, n)
    for a, b in zip(dev + host, ref_dev + ref_host):
        assert torch.equal(a, b)
