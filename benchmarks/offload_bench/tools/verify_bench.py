"""What `verify_loads` costs on the CPU backend: store and load throughput through the worker's real transfer engine
with and without block checksums.

Per page size: a KV cache of 4 page tensors per block (device rows padded by 256 bytes, as vLLM's page views), a
block-first host tier, the copier `auto` picks on CPU (the compiled `host` copier), and one store job then one load
job of `--total-mib` each over random permuted block ids, timed from submission to the poll that reports them (what
the worker waits for). With `verify_loads` a store also checksums its source blocks and a load its destination
blocks and compares them with the stored sums (offload_connector/worker/checksum.py). Plain and verified jobs are
interleaved, `--repeats` times; medians. Also the checksum alone (GB/s of blocks summed). A measurement, not a test.

    .venv-cpu/bin/offload-connector verify-bench [--pages 16384,65536,262144,2621440] [--total-mib 128]
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from offload_bench.args import OneLineParser, add_copy_layout_args
from offload_connector.kernels import allocate_host_tier, make_copier
from offload_connector.metadata import TransferJob
from offload_connector.worker.checksum import BlockChecksummer, SlotChecksums
from offload_connector.worker.transfers import TransferEngine


def _run_job(engine: TransferEngine, kind: str, job: TransferJob) -> tuple[float, bool]:
    t0 = time.perf_counter()
    (engine.submit_store if kind == "store" else engine.submit_load)(job)
    results = []
    while not results:
        results = engine.poll()
    return time.perf_counter() - t0, all(r.ok for r in results)


def run(page: int, total_bytes: int, tensors: int, pad: int, repeats: int, seed: int) -> list[dict]:
    blocks = max(1, total_bytes // (page * tensors))
    pool = 2 * blocks
    gen = torch.Generator().manual_seed(seed)
    dev_base = [torch.randint(0, 256, (pool, page + pad), dtype=torch.uint8, generator=gen) for _ in range(tensors)]
    dev = [b[:, :page] for b in dev_base]
    tier = allocate_host_tier(pool, page * tensors, pin=False)
    host = [tier.tensor[:, t * page:(t + 1) * page] for t in range(tensors)]
    segments = [list(range(tensors))]
    copier = make_copier("auto", dev, host, segments, device=torch.device("cpu"))
    checksummer = BlockChecksummer(dev, segments, [t * page for t in range(tensors)])
    engines = {"plain": TransferEngine(copier, 1, [page * tensors], torch.device("cpu")),
               "verified": TransferEngine(copier, 1, [page * tensors], torch.device("cpu"),
                                          checksums=SlotChecksums(checksummer, pool))}
    rng = np.random.default_rng(seed)
    src = tuple(int(x) for x in rng.permutation(pool)[:blocks])
    dst = tuple(int(x) for x in rng.permutation(pool)[:blocks])
    slots = tuple(int(x) for x in rng.permutation(pool)[:blocks])
    nbytes = blocks * page * tensors
    times: dict[tuple[str, str], list[float]] = {}
    ok = True
    job_id = 0
    for rep in range(repeats + 1):  # the first round warms up (first touch, the copier's build) and is dropped
        for mode, engine in engines.items():
            for kind in ("store", "load"):
                job_id += 1
                job = TransferJob(job_id, "r", (tuple(src if kind == "store" else dst),), (tuple(slots),))
                seconds, landed = _run_job(engine, kind, job)
                ok = ok and landed
                if rep:
                    times.setdefault((mode, kind), []).append(seconds)
    ids = np.asarray(src, dtype=np.int64)
    checksummer.compute(0, ids)
    sum_times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        checksummer.compute(0, ids)
        sum_times.append(time.perf_counter() - t0)
    med = statistics.median
    rows = []
    for kind in ("store", "load"):
        plain, verified = med(times[("plain", kind)]), med(times[("verified", kind)])
        rows.append({"direction": kind, "page_bytes": page, "tensors": tensors, "blocks": blocks, "bytes": nbytes,
                     "backend": copier.name, "plain_gbps": nbytes / plain / 1e9,
                     "verified_gbps": nbytes / verified / 1e9, "verified_over_plain": plain / verified,
                     "checksum_gbps": nbytes / med(sum_times) / 1e9, "all_ok": ok})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="offload-connector verify-bench", description=__doc__.splitlines()[0])
    add_copy_layout_args(p, total_mib=128, repeats=5)
    p.add_argument("--json", type=Path, help="also write the rows as JSON here")
    a = p.parse_args(argv)
    p.check_output("--json", a.json)  # before the run, not after
    pages = a.pages
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), {a.total_mib} MiB per job, {a.tensors} tensors, pad {a.pad}")
    print(f"{'job':6} {'page':>8} {'blocks':>7} {'plain GB/s':>11} {'verified GB/s':>14} {'verified/plain':>15} "
          f"{'checksum GB/s':>14} backend")
    rows = []
    for page in pages:
        for r in run(page, a.total_mib << 20, a.tensors, a.pad, a.repeats, a.seed):
            rows.append(r)
            print(f"{r['direction']:6} {page:>8} {r['blocks']:>7} {r['plain_gbps']:>11.2f} {r['verified_gbps']:>14.2f} "
                  f"{r['verified_over_plain']:>15.2f} {r['checksum_gbps']:>14.2f} {r['backend']}")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["all_ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
