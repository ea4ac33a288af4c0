"""CPU-backend copy throughput: block gather/scatter vs one large copy of the same bytes.

The CPU backend (vLLM's CPU engine) moves KV pages between two host buffers with the compiled `host` copier
(`kernels/host_copy.c`, streaming stores), or with the `reference` copier (a memoryview slice per page) where no C
compiler is found. Both are measured against one contiguous copy of the same byte count, as one glibc `memmove` and
as torch `copy_`; the ratio is against the faster of the two (goal >= 0.8). Both directions; random permuted block
ids; strided device views (row stride = page + pad, as vLLM's page views); single-threaded like the large copy;
every timed configuration is byte-verified once.

    .venv-cpu/bin/offload-connector cpu-copy-bench [--pages 16384,65536,262144,2621440] [--total-mib 256]
"""
from __future__ import annotations

import ctypes
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from offload_bench.args import OneLineParser, add_copy_layout_args
from offload_connector.kernels import ReferenceCopier, allocate_host_tier
from offload_connector.kernels.host_copy import ISAS, HostCopier


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _fill(t: torch.Tensor, gen: torch.Generator) -> None:
    """Random bytes, made cheaply: one random MiB tiled, then each row's first 8 bytes set to its row number so a
    misplaced or duplicated row cannot verify."""
    flat = t.view(-1) if t.is_contiguous() else None
    chunk = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=gen)
    target = flat if flat is not None else t.reshape(-1)
    for off in range(0, target.numel(), chunk.numel()):
        n = min(chunk.numel(), target.numel() - off)
        target[off:off + n] = chunk[:n]
    if flat is None:
        t.copy_(target.view(t.shape))
    if t.dim() == 2 and t.shape[1] >= 8:
        t[:, :8] = torch.arange(t.shape[0], dtype=torch.int64).view(-1, 1).view(torch.uint8).view(-1, 8)


def run(page: int, total_bytes: int, tensors: int, pad: int, repeats: int, seed: int,
        isa: str | None = None) -> list[dict]:
    blocks = max(1, total_bytes // (page * tensors))
    nbytes = blocks * page * tensors
    pool = 2 * blocks
    gen = torch.Generator().manual_seed(seed)
    dev_base = [torch.empty((pool, page + pad), dtype=torch.uint8) for _ in range(tensors)]
    for b in dev_base:
        _fill(b, gen)
    dev = [b[:, :page] for b in dev_base]
    tier = allocate_host_tier(pool, page * tensors, pin=False)  # block-first arena, as the connector lays it out
    _fill(tier.tensor, gen)
    host = [tier.tensor[:, t * page:(t + 1) * page] for t in range(tensors)]
    copiers = {"host": HostCopier(dev, host, [list(range(tensors))], isa=isa),
               "reference": ReferenceCopier(dev, host, [list(range(tensors))])}
    rng = np.random.default_rng(seed)
    host_ids = rng.permutation(pool)[:blocks].astype(np.int64)
    dev_ids = rng.permutation(pool)[:blocks].astype(np.int64)
    ids = [(host_ids, dev_ids)]

    src_flat = torch.empty((nbytes,), dtype=torch.uint8)
    _fill(src_flat, gen)
    dst_flat = torch.zeros_like(src_flat)
    big_torch = lambda: dst_flat.copy_(src_flat)  # noqa: E731
    big_memmove = lambda: ctypes.memmove(dst_flat.data_ptr(), src_flat.data_ptr(), nbytes)  # noqa: E731

    rows = []
    for direction in ("h2d", "d2h"):
        fns = {"memmove": big_memmove, "torch": big_torch}
        for name, c in copiers.items():
            fns[name] = lambda c=c: c.copy(direction, ids)
        for fn in fns.values():
            fn()  # warm-up: first touch, caches
        # Interleaved samples: on a shared machine the load drifts; each ratio compares neighbours in time.
        times: dict[str, list[float]] = {k: [] for k in fns}
        ratios: dict[str, list[float]] = {k: [] for k in copiers}
        ratios_torch: dict[str, list[float]] = {k: [] for k in copiers}
        ratios_mm: dict[str, list[float]] = {k: [] for k in copiers}
        for _ in range(repeats):
            t = {k: _timed(fn) for k, fn in fns.items()}
            for k, v in t.items():
                times[k].append(v)
            for k in copiers:
                ratios[k].append(min(t["memmove"], t["torch"]) / t[k])
                ratios_torch[k].append(t["torch"] / t[k])
                ratios_mm[k].append(t["memmove"] / t[k])
        hi = torch.from_numpy(host_ids)
        di = torch.from_numpy(dev_ids)
        verified = {}
        for k, c in copiers.items():
            # Each backend is verified on its own: scramble the destination, copy once more, compare.
            for t in (dev if direction == "h2d" else host):
                t.index_fill_(0, di if direction == "h2d" else hi, 0x5A)
            c.copy(direction, ids)
            verified[k] = all(torch.equal(d.index_select(0, di), h.index_select(0, hi)) for d, h in zip(dev, host))
        med = statistics.median
        row = {"direction": direction, "page_bytes": page, "tensors": tensors, "blocks": blocks, "bytes": nbytes,
               "isa": copiers["host"].isa,
               "large_copy_torch_gbps": nbytes / med(times["torch"]) / 1e9,
               "large_copy_memmove_gbps": nbytes / med(times["memmove"]) / 1e9}
        for k in copiers:
            row[f"{k}_gbps"] = nbytes / med(times[k]) / 1e9
            row[f"{k}_ratio_to_large_copy"] = med(ratios[k])
            row[f"{k}_ratio_to_torch_copy"] = med(ratios_torch[k])
            row[f"{k}_ratio_to_memmove"] = med(ratios_mm[k])
            row[f"{k}_verified"] = bool(verified[k])
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="offload-connector cpu-copy-bench", description=__doc__.splitlines()[0])
    add_copy_layout_args(p, total_mib=256, repeats=7)
    p.add_argument("--isa", choices=ISAS, help="force the host backend's store path (default: the best this CPU has)")
    p.add_argument("--json", type=Path, help="also write the rows as JSON here")
    a = p.parse_args(argv)
    p.check_output("--json", a.json)  # before the run, not after
    pages = a.pages
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), {a.total_mib} MiB per call, {a.tensors} tensors, pad {a.pad}")
    print(f"{'dir':4} {'page':>8} {'blocks':>7} {'host':>7} {'reference':>10} {'memmove':>8} {'torch copy_':>12} "
          f"{'host ratio':>11} {'ref ratio':>10} {'host vs memmove':>16} {'host vs copy_':>14} verified   "
          "(GB/s; ratio = vs the faster large copy)")
    rows = []
    for page in pages:
        for r in run(page, a.total_mib << 20, a.tensors, a.pad, a.repeats, a.seed, a.isa):
            rows.append(r)
            print(f"{r['direction']:4} {page:>8} {r['blocks']:>7} {r['host_gbps']:>7.2f} {r['reference_gbps']:>10.2f} "
                  f"{r['large_copy_memmove_gbps']:>8.2f} {r['large_copy_torch_gbps']:>12.2f} "
                  f"{r['host_ratio_to_large_copy']:>11.2f} {r['reference_ratio_to_large_copy']:>10.2f} "
                  f"{r['host_ratio_to_memmove']:>16.2f} "
                  f"{r['host_ratio_to_torch_copy']:>14.2f} {r['host_verified'] and r['reference_verified']}")
    print(f"# host backend store path: {rows[0]['isa'] if rows else '-'}")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["host_verified"] and r["reference_verified"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
