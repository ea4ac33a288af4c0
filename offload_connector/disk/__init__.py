"""The disk tier: blocks evicted from the CPU tier, kept in fixed-size slots of one file in a local directory.

- `format`: the on-disk format (header with the fingerprint, per-slot records, CRCs); plain Python.
- `index`: `DiskIndex` (key -> slot, LRU) and `scan_directory` (rebuild it from disk); plain Python, so the scheduler
  side imports it without torch or numpy.
- `store`: `DiskStore`, the bytes: async pwrite/pread through a thread pool, O_DIRECT, budget, counters (numpy).

This package imports `store` lazily, so `import offload_connector.disk` stays torch- and numpy-free.
"""
from offload_connector.disk.format import (
    FORMAT_VERSION, DiskFingerprint, DiskFormatError, FingerprintMismatch,
)
from offload_connector.disk.index import DiskIndex, Key, scan_directory


def __getattr__(name: str):
    if name in ("DiskStore", "DiskIO", "DiskStats"):
        from offload_connector.disk import store
        return getattr(store, name)
    raise AttributeError(name)


__all__ = ["FORMAT_VERSION", "DiskFingerprint", "DiskFormatError", "FingerprintMismatch", "DiskIndex", "Key",
           "scan_directory", "DiskStore", "DiskIO", "DiskStats"]
