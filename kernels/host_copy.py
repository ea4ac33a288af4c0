"""Host backend: page gather/scatter between two host buffers in compiled code (vLLM's CPU backend).

`host_copy.c` is compiled on first use with the system C compiler (`CC`, else `cc`), cached under
`OFFLOAD_CONNECTOR_CACHE_DIR` (default `~/.cache/offload-connector/host_copy`) by a hash of the source, compiler and
machine, and loaded with ctypes. vLLM's CPU backend already needs a C compiler for torch.compile, so one is there
where this backend matters; without one, `make_copier("auto")` falls back to the reference path with a warning.
Ids are validated by `BlockCopier.copy` before any pointer is formed, so the C code never sees a foreign row.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from .api import BlockCopier, Completion

SOURCE = Path(__file__).with_name("host_copy.c")
ENV_CACHE_DIR = "OFFLOAD_CONNECTOR_CACHE_DIR"
ISAS: tuple[str, ...] = ("memcpy", "sse2", "avx2", "avx512")
CFLAGS: tuple[str, ...] = ("-O2", "-std=c11", "-shared", "-fPIC")

_lock = threading.Lock()
_loaded: dict[tuple[str, str], ctypes.CDLL] = {}


class HostCopyUnavailable(RuntimeError):
    """The host backend's C source could not be compiled or loaded here."""


def _compiler() -> list[str]:
    cc = shlex.split(os.environ.get("CC", "").strip() or "cc")
    if shutil.which(cc[0]) is None:
        raise HostCopyUnavailable(f"no C compiler: {cc[0]!r} not found (set CC to one)")
    return cc


def cache_dir() -> Path:
    """Where compiled libraries are kept (created on demand)."""
    env = os.environ.get(ENV_CACHE_DIR, "").strip()
    if env:
        return Path(env).expanduser() / "host_copy"
    return Path.home() / ".cache" / "offload-connector" / "host_copy"


def library_path() -> Path:
    """The cached library for the current source, compiler and machine (may not exist yet)."""
    cc = _compiler()
    key = hashlib.sha256(SOURCE.read_bytes() + repr((cc, CFLAGS, platform.machine())).encode()).hexdigest()[:16]
    return cache_dir() / f"host_copy-{platform.machine()}-{key}.so"


def _compile(cc: list[str], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    # Compile beside the target and rename: concurrent workers (tensor parallel) never load a half-written file.
    fd, tmp = tempfile.mkstemp(prefix=".host_copy-", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([*cc, *CFLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise HostCopyUnavailable(f"{' '.join(cc)} failed on {SOURCE.name} (exit {proc.returncode}): "
                                      f"{(proc.stderr or proc.stdout).strip()[-2000:]}")
        os.replace(tmp, out)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise HostCopyUnavailable(f"compiling {SOURCE.name} with {' '.join(cc)} failed: {exc}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_library() -> ctypes.CDLL:
    """Compile (once per source/compiler/machine) and load the host copy library; raises HostCopyUnavailable."""
    cc = _compiler()
    path = library_path()
    key = (str(path), " ".join(cc))
    with _lock:
        lib = _loaded.get(key)
        if lib is not None:
            return lib
        if not path.exists():
            try:
                _compile(cc, path)
            except OSError:  # cache dir not writable (read-only home, foreign owner): build in a private temp dir
                path = Path(tempfile.mkdtemp(prefix="offload-connector-")) / path.name
                _compile(cc, path)
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as exc:
            raise HostCopyUnavailable(f"loading {path} failed: {exc}") from exc
        lib.oc_best_isa.restype = ctypes.c_int
        lib.oc_best_isa.argtypes = []
        lib.oc_copy_blocks.restype = ctypes.c_int
        lib.oc_copy_blocks.argtypes = [ctypes.c_int, ctypes.c_int64] + [ctypes.c_void_p] * 7 + [ctypes.c_int64]
        _loaded[key] = lib
        return lib


def best_isa() -> str:
    """The fastest store path this CPU supports (one of ISAS)."""
    return ISAS[load_library().oc_best_isa()]


class HostCopier(BlockCopier):
    """Copies pages between two host buffers in one C call per KV cache group, synchronously.

    isa: force one of ISAS (tests, benchmarks); default the best the CPU supports.
    """

    name = "host"

    def __init__(self, device_pages: Sequence[torch.Tensor], host_pages: Sequence[torch.Tensor],
                 segments: Sequence[Sequence[int]], isa: str | None = None) -> None:
        super().__init__(device_pages, host_pages, segments)
        if self.device.type != "cpu":
            raise RuntimeError(f"the 'host' backend copies between two host buffers (vLLM's CPU backend); the KV "
                               f"cache is on {self.device}")
        self._lib = load_library()
        best = self._lib.oc_best_isa()
        if isa is None:
            self._isa = best
        elif isa not in ISAS:
            raise ValueError(f"isa {isa!r} is not one of {ISAS}")
        elif ISAS.index(isa) > best:
            raise ValueError(f"isa {isa!r} is not supported by this CPU; accepted: {ISAS[:best + 1]}")
        else:
            self._isa = ISAS.index(isa)
        self.isa = ISAS[self._isa]
        # Per group, the C call's tables: base pointers, row strides and page bytes of its tensors on each side.
        self._tables: list[dict[str, np.ndarray]] = []
        for seg in self.segments:
            ts = [t for t in seg if self.layouts[t].page_bytes > 0]
            self._tables.append({
                "dev": np.array([self.device_pages[t].data_ptr() for t in ts], dtype=np.int64),
                "host": np.array([self.host_pages[t].data_ptr() for t in ts], dtype=np.int64),
                "dev_stride": np.array([self.layouts[t].device_stride for t in ts], dtype=np.int64),
                "host_stride": np.array([self.layouts[t].host_stride for t in ts], dtype=np.int64),
                "size": np.array([self.layouts[t].page_bytes for t in ts], dtype=np.int64),
            })

    def _copy(self, direction: str, ids: list[tuple[np.ndarray, np.ndarray] | None],
              stream: "torch.cuda.Stream | None") -> Completion:
        for g, pair in enumerate(ids):
            tab = self._tables[g]
            if pair is None or tab["size"].size == 0:
                continue
            host_ids = np.ascontiguousarray(pair[0], dtype=np.int64)
            dev_ids = np.ascontiguousarray(pair[1], dtype=np.int64)
            if direction == "h2d":
                dst, src, dst_ids, src_ids = "dev", "host", dev_ids, host_ids
            else:
                dst, src, dst_ids, src_ids = "host", "dev", host_ids, dev_ids
            rc = self._lib.oc_copy_blocks(
                self._isa, int(tab["size"].size), tab[dst].ctypes.data, tab[src].ctypes.data,
                tab[f"{dst}_stride"].ctypes.data, tab[f"{src}_stride"].ctypes.data, tab["size"].ctypes.data,
                dst_ids.ctypes.data, src_ids.ctypes.data, int(dst_ids.size))
            if rc != 0:
                raise RuntimeError(f"host copy refused isa {self.isa!r} (rc {rc})")
        return Completion()
