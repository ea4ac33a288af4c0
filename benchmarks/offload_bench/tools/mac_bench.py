"""What authenticating the shared tier costs: framing and checking values with the CRC alone against with the
HMAC-SHA256 tag (`remote_secret_file`), on this machine, one thread, through the code the stores run
(`remote.base.pack_value` / `check_value`).

Per block size: MB/s of writing (pack: header, CRC, copy, tag) and reading (check: header, CRC or tag, the data view).
With `--replay-json` (results of `offload-connector replay --engines 2 ... --json`, whose simulated store moves tags,
not bytes, and charges no check) the cost per shared-tier fetch of that replay is estimated from these rates: its
bytes fetched per fetch, checked with the CRC alone and with the tag, against the fetch time the replay charged.

With `--disk DIR` the disk tier (`disk_secret_file`) is measured end to end as well: `DiskStore` writing and reading
one slot at a time in DIR with and without a MAC key (page cache and buffered I/O, so the check is what differs).

    .venv-vllm033/bin/offload-connector mac-bench [--sizes 32Ki,256Ki,1Mi,4Mi] [--seconds 1] [--json F] [--disk DIR]

Exit status 2 with one line for a bad argument.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from offload_bench.args import OneLineParser, fail, float_in
from offload_connector.remote import base

KEY = base.derive_mac_key(b"benchmark secret, 32 bytes long!")
DISK_KEY = b"k" * 32


def parse_size(text: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20}
    for u, mult in units.items():
        if text.endswith(u):
            return int(text[:-2]) * mult
    return int(text)


def rate(fn: Any, nbytes: int, seconds: float) -> float:
    """MB/s (10^6 bytes per second) of calling fn() repeatedly for about `seconds` (after one warm-up call)."""
    fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        dt = time.perf_counter() - t0
        if dt >= seconds:
            return n * nbytes / dt / 1e6


def measure(size: int, seconds: float) -> dict[str, Any]:
    fp = base.RemoteFingerprint(model="bench", layout="x", dtype="bf16", group_block_bytes=(size,), block_sizes=(16,))
    name = base.RemoteKey(fp).name(0, b"\x01" * 32)
    digest = fp.digest()
    data = os.urandom(size)
    plain = base.pack_value(digest, name, data)
    tagged = base.pack_value(digest, name, data, KEY)
    assert bytes(base.check_value(tagged, digest, name, size, KEY)[0]) == data
    row = {"block_bytes": size}
    row["write_crc_MBps"] = rate(lambda: base.pack_value(digest, name, data), size, seconds)
    row["write_mac_MBps"] = rate(lambda: base.pack_value(digest, name, data, KEY), size, seconds)
    row["read_crc_MBps"] = rate(lambda: base.check_value(plain, digest, name, size), size, seconds)
    row["read_mac_MBps"] = rate(lambda: base.check_value(tagged, digest, name, size, KEY), size, seconds)
    return row


def measure_disk(size: int, seconds: float, directory: str) -> dict[str, Any]:
    """DiskStore round trips of one `size`-byte slot (write a new key, read it back), without and with a MAC key."""
    import shutil
    import numpy as np
    from offload_connector.disk import DiskFingerprint
    from offload_connector.disk.format import HEADER_BYTES, slot_stride
    from offload_connector.disk.store import DiskStore

    fp = DiskFingerprint("bench", (size,), (16,), "bf16", size)
    data = np.frombuffer(os.urandom(size), dtype=np.uint8)
    out = np.empty(size, dtype=np.uint8)
    row: dict[str, Any] = {}
    for name, key in (("crc", None), ("mac", DISK_KEY)):
        path = os.path.join(directory, f"mac-bench-{size}-{name}")
        shutil.rmtree(path, ignore_errors=True)
        with DiskStore(path, fp, HEADER_BYTES + 64 * slot_stride(size), direct=False, mac_key=key) as store:
            keys = iter(range(1 << 62))

            def write() -> None:
                assert store.write((0, next(keys)), data).wait()
            row[f"disk_write_{name}_MBps"] = rate(write, size, seconds)
            last = (0, next(keys))
            assert store.write(last, data).wait()

            def read() -> None:
                assert store.read(last, out).wait()
            row[f"disk_read_{name}_MBps"] = rate(read, size, seconds)
        shutil.rmtree(path, ignore_errors=True)
    return row


def per_fetch(path: str, rows: list[dict[str, Any]]) -> list[str]:
    """Lines estimating what the check costs per shared-tier fetch of a router replay, at the measured read rates of
    the block size closest to that replay's blocks."""
    doc = json.loads(Path(path).read_text())
    lines = []
    cfg = doc.get("config", {})
    for res in doc.get("results", []):
        extra = res.get("extra") or {}
        fetches, nbytes, blocks = (extra.get("shared_fetches"), extra.get("shared_bytes_fetched"),
                                   extra.get("shared_blocks_fetched"))
        if not fetches or not nbytes or not blocks:
            continue
        per, block = nbytes / fetches, nbytes / blocks
        row = min(rows, key=lambda r: abs(r["block_bytes"] - block))
        crc_ms = per / (row["read_crc_MBps"] * 1e6) * 1e3
        mac_ms = per / (row["read_mac_MBps"] * 1e6) * 1e3
        link_ms = cfg.get("shared_latency_ms", 0.0) + per / (cfg.get("shared_bandwidth_gbps", 10.0) * 1e9) * 1e3
        lines.append(f"{path}: {fetches} fetches, {per / 1e6:,.1f} MB each ({block / 1024:,.0f} KiB blocks): checking "
                     f"one fetch takes {crc_ms:.1f} ms with the CRC alone, {mac_ms:.1f} ms with the tag "
                     f"(+{mac_ms - crc_ms:.1f} ms, one thread, rates of the {row['block_bytes'] >> 10} KiB row); the "
                     f"replay charged {link_ms:.1f} ms of link time per fetch and no check")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="offload-connector mac-bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="32Ki,384Ki,2560Ki", help="value sizes (bytes, or with Ki/Mi), comma-separated")
    p.add_argument("--seconds", type=float_in(0.001, 60), default=1.0, help="time per measurement (up to 60)")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--replay-json", nargs="*", default=[], help="router replay results to estimate per fetch")
    p.add_argument("--disk", default=None, help="also measure the disk tier's slots in this directory")
    args = p.parse_args(argv)
    try:
        sizes = [parse_size(x.strip()) for x in args.sizes.split(",") if x.strip()]
        if not sizes or any(s <= 0 or s > 1 << 30 for s in sizes):
            raise ValueError
    except ValueError:
        return fail(p.prog, f"--sizes must be sizes in 1..1Gi such as 32Ki,1Mi; got {args.sizes!r}")
    for path in args.replay_json:
        if not Path(path).is_file():
            return fail(p.prog, f"--replay-json {path}: not a file")
    if args.disk is not None and not os.path.isdir(args.disk):
        return fail(p.prog, f"--disk {args.disk!r}: not a directory")
    p.check_output("--json", args.json)  # before the run, not after
    rows = [measure(s, args.seconds) for s in sizes]
    if args.disk is not None:
        for r in rows:
            r.update(measure_disk(r["block_bytes"], args.seconds, args.disk))
    print(f"MB/s, one thread, {os.cpu_count()} CPUs (as RemoteStore.put / get frame and check values)")
    print("| block | write, CRC | write, CRC + tag | read, CRC | read, tag |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['block_bytes'] >> 10} KiB | {r['write_crc_MBps']:,.0f} | {r['write_mac_MBps']:,.0f} | "
              f"{r['read_crc_MBps']:,.0f} | {r['read_mac_MBps']:,.0f} |")
    if args.disk is not None:
        print(f"\nDisk tier in {args.disk}, MB/s, one slot per call (DiskStore.write / read, buffered I/O)")
        print("| block | write, CRC | write, CRC + tag | read, CRC | read, tag |")
        print("|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['block_bytes'] >> 10} KiB | {r['disk_write_crc_MBps']:,.0f} | {r['disk_write_mac_MBps']:,.0f} | "
                  f"{r['disk_read_crc_MBps']:,.0f} | {r['disk_read_mac_MBps']:,.0f} |")
    for path in args.replay_json:
        try:
            for line in per_fetch(path, rows):
                print(line)
        except (OSError, ValueError) as exc:
            return fail(p.prog, f"--replay-json {path}: {exc}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
