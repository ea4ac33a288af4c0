"""What KV copies cost the forward pass running beside them, per copy backend, on one GPU. A measurement, never a test.

The copy kernel moves pages with SMs; the DMA backends (`batch`, `per_page`) use the copy engines. Either shares the
GPU with the model's forward. On a Gemma-4-31B-shaped call (60 tensors of 256 KiB pages in two groups, the layout
stage of transfer_bench.py) this times, each alone and then overlapped (copies back to back on a side stream while
the compute runs on another):
  matmul  bf16 8192^3 products (a prefill-like, compute-bound forward)
  stream  a bf16 matrix-vector product over 2 GiB (a decode-like, HBM-bound forward)
and reports the compute's throughput overlapped / alone and the copies' GB/s overlapped / alone. Every overlapped copy
is byte-verified afterwards. Also records what the connector's start-up calibration (`kernels.select.calibrate`)
picks for this layout, and its timings.

    PYTHONPATH=. offload-connector overlap-bench --out DIR            # on a GPU, about 1 minute on an H200
    PYTHONPATH=. offload-connector overlap-bench --out DIR --cpu-smoke  # code path only, tiny sizes, no timing value
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from offload_bench.args import ArgError, OneLineParser, check_output_dir, fail, int_in
from offload_connector.kernels import allocate_host_tier, make_copier
from offload_connector.kernels.select import calibrate

KIB = 1024
MAX_COPIES = 1000  # calls per overlapped window: 1,000 Gemma-shaped calls are about 40 s of copying on an H200


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineParser(prog="offload-connector overlap-bench", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory for results.json and results.md")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU: checks the code path only")
    p.add_argument("--copies", type=int_in(1, MAX_COPIES), default=12,
                   help=f"copy calls per overlapped window (default 12, at most {MAX_COPIES})")
    return p.parse_args(argv)


def _queue(calls: int, fn: Callable[[], Any], stream: Any) -> Callable[[], float]:
    """Queue `calls` calls of `fn` on `stream` without waiting; returns a function that waits for them and gives the
    seconds they took (CUDA events on the stream; on CPU, `stream` None, they run now and wall time is kept)."""
    if stream is None:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        dt = time.perf_counter() - t0
        return lambda: dt
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        for _ in range(calls):
            fn()
        end.record(stream)
    return lambda: (end.synchronize(), start.elapsed_time(end) / 1e3)[1]


class Work:
    """A compute loop on its own stream, timed with CUDA events (wall time on CPU)."""

    def __init__(self, name: str, fn: Callable[[], Any], units: float, unit: str, reps: int,
                 device: torch.device) -> None:
        self.name, self.fn, self.units, self.unit, self.reps = name, fn, units, unit, reps
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def submit(self) -> Callable[[], float]:
        """Queue reps calls; returns a function that waits and gives the seconds they took."""
        return _queue(self.reps, self.fn, self.stream)

    def rate(self, seconds: float) -> float:
        return self.units * self.reps / seconds


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        out = check_output_dir("--out", args.out)
    except ArgError as err:
        return fail("offload-connector overlap-bench", err)
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        print("overlap_bench.py: no CUDA device (use --cpu-smoke for a dry run)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if smoke else "cuda")
    page, n_sliding, n_full = (4 * KIB, 3, 2) if smoke else (256 * KIB, 50, 10)
    blocks = (4, 8) if smoke else (64, 512)
    rows = 16 if smoke else 600
    nt = n_sliding + n_full
    gen = torch.Generator().manual_seed(0)
    dev = [torch.randint(0, 256, (rows, page), dtype=torch.uint8, generator=gen).to(device) for _ in range(nt)]
    tier = allocate_host_tier(rows, nt * page, pin=not smoke)
    tier.tensor.copy_(torch.randint(0, 256, (rows, nt * page), dtype=torch.uint8, generator=gen))
    host = [tier.tensor[:, t * page:(t + 1) * page] for t in range(nt)]
    segs = [list(range(n_sliding)), list(range(n_sliding, nt))]
    rng = np.random.default_rng(1)
    ids = [(rng.permutation(rows)[:n].astype(np.int64), rng.permutation(rows)[:n].astype(np.int64)) for n in blocks]
    nbytes = sum(n * len(s) * page for n, s in zip(blocks, segs))
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if not smoke else "cpu (smoke: no timing value)",
                           "torch": torch.__version__, "page_bytes": page, "tensors": nt, "blocks_per_group": blocks,
                           "bytes_per_call": nbytes, "copies_per_window": args.copies, "rows": [], "calibration": {}}

    # What the connector's start-up calibration picks for this layout (its own timings, from its log line).
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    log = logging.getLogger("vllm.offload_connector.kernels")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    if not smoke:
        t0 = time.perf_counter()
        choice = calibrate(dev, segs, device)
        res["calibration"] = {"choice": choice, "seconds": time.perf_counter() - t0,
                              "log": [r.getMessage() for r in records]}
    log.removeHandler(handler)

    n = 64 if smoke else 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16 if not smoke else torch.float32)
    b = torch.randn(n, n, device=device, dtype=a.dtype)
    m_rows = 256 if smoke else 16384
    mat = torch.randn(m_rows, (1 << 30) // m_rows if not smoke else 256, device=device, dtype=a.dtype)
    vec = torch.randn(mat.shape[1], device=device, dtype=a.dtype)
    works = [Work("matmul", lambda: a @ b, 2 * n ** 3 / 1e12, "TFLOP/s", 2 if smoke else 200, device),
             Work("stream", lambda: mat @ vec, mat.numel() * mat.element_size() / 1e9, "GB/s",
                  2 if smoke else 400, device)]
    copy_stream = torch.cuda.Stream(device) if not smoke else None

    def copies(copier: Any, direction: str) -> Callable[[], float]:
        # On CPU each copy runs to its end here; on a GPU they are queued on the copy stream, back to back.
        call = (lambda: copier.copy(direction, ids, None).wait()) if smoke else \
            (lambda: copier.copy(direction, ids, copy_stream))
        return _queue(args.copies, call, copy_stream)

    def landed(direction: str) -> bool:
        """Every copied page equals its source (the last call's; every call of a window copies the same ids)."""
        for t, d in enumerate(dev):
            h_ids, d_ids = (torch.from_numpy(x) for x in ids[0 if t < n_sliding else 1])
            if not torch.equal(d.index_select(0, d_ids.to(device)).cpu(), host[t].index_select(0, h_ids)):
                return False
        return True

    for w in works:  # warm-up, then the time of one call alone
        w.reps, reps = 1, w.reps
        w.submit()()
        w.reps = reps
    alone = {w.name: w.rate(w.submit()()) for w in works}
    per_call = {w.name: w.units / alone[w.name] for w in works}
    backends = ("reference",) if smoke else ("kernel", "batch", "per_page")
    for name in backends:
        copier = make_copier(name, dev, host, segs, device=device)
        for direction in ("h2d", "d2h"):
            copies(copier, direction)()  # warm-up
            window = copies(copier, direction)()
            copy_alone = nbytes * args.copies / window / 1e9
            for w in works:
                # As many compute calls as fill the copies' window alone, so that each side overlaps the other
                # for most of its time (the copies slow down or not; the ratio says).
                w.reps = max(1, round(window / per_call[w.name]))
                wait_w = w.submit()
                wait_c = copies(copier, direction)
                w_s, c_s = wait_w(), wait_c()
                ok = landed(direction)
                gbps = nbytes * args.copies / c_s / 1e9
                res["rows"].append({
                    "backend": name, "direction": direction, "compute": w.name, "unit": w.unit,
                    "compute_calls": w.reps, "compute_alone": alone[w.name], "compute_overlapped": w.rate(w_s),
                    "compute_ratio": w.rate(w_s) / alone[w.name], "copy_gbps_alone": copy_alone,
                    "copy_gbps_overlapped": gbps, "copy_ratio": gbps / copy_alone, "compute_s": w_s, "copy_s": c_s,
                    "verified": ok})
                print(f"{name:9s} {direction} + {w.name:6s}: compute {w.rate(w_s):8.1f} {w.unit} "
                      f"({w.rate(w_s) / alone[w.name]:.3f} of alone), copy {gbps:6.2f} GB/s "
                      f"({gbps / copy_alone:.3f} of alone {copy_alone:.2f}), windows: compute {w_s * 1e3:.0f} ms, "
                      f"copy {c_s * 1e3:.0f} ms; verified {ok}", flush=True)
        copier.close()
    tier.close()
    res["alone"] = alone
    (out / "results.json").write_text(json.dumps(res, indent=1, default=str))
    lines = [f"# Copies beside compute ({res['device']}, torch {res['torch']})", "",
             f"Gemma-4-31B-shaped call: {nt} tensors, {page // KIB} KiB pages, blocks per group {blocks}, "
             f"{nbytes / 1e9:.2f} GB per call, {args.copies} calls per window.", "",
             f"Alone: matmul {alone['matmul']:.1f} TFLOP/s, stream {alone['stream']:.1f} GB/s.", ""]
    if res["calibration"]:
        lines += [f"Calibration picks {res['calibration']['choice']} in {res['calibration']['seconds']:.2f} s.", ""]
    lines += ["| backend | dir | compute | compute overlapped / alone | copy GB/s alone | overlapped | ratio | verified |",
              "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['backend']} | {r['direction']} | {r['compute']} | {r['compute_ratio']:.3f} | "
                     f"{r['copy_gbps_alone']:.2f} | {r['copy_gbps_overlapped']:.2f} | {r['copy_ratio']:.3f} | "
                     f"{r['verified']} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    return 0 if all(r["verified"] for r in res["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
