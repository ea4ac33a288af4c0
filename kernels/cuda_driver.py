"""CUDA driver entry points the DMA backends call through ctypes, resolved with `cuGetProcAddress`.

`cuda.bindings` (a torch 2.14 dependency) resolves the symbols; the calls themselves go through ctypes function
pointers because they take raw descriptor arrays (numpy buffers), which is cheaper than building binding objects
per page. Everything is resolved on first use: importing this module needs no driver.
"""
from __future__ import annotations

import ctypes
import functools
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from types import ModuleType

# CUmemcpySrcAccessOrder. STREAM: the source is read in stream order (required when earlier work on the stream may
# still write it, e.g. a store reading live KV). ANY: the source may be read early (only for a stable source).
SRC_ACCESS_ORDER_STREAM = 1
SRC_ACCESS_ORDER_ANY = 3

# cuMemcpyBatchAsync appeared in 12.8; asking for that ABI keeps the failIdx argument (dropped in the 13.0 ABI).
_BATCH_ABI_VERSION = 12080
_MEMCPY_ABI_VERSION = 4000


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class CUmemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_uint), ("srcLocHint", CUmemLocation),
                ("dstLocHint", CUmemLocation), ("flags", ctypes.c_uint)]


# CUresult cuMemcpyBatchAsync(CUdeviceptr* dsts, CUdeviceptr* srcs, size_t* sizes, size_t count,
#     CUmemcpyAttributes* attrs, size_t* attrsIdxs, size_t numAttrs, size_t* failIdx, CUstream hStream)
BATCH_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p)
# CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream)
MEMCPY_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p)


class DriverError(RuntimeError):
    """A driver entry point is missing or returned an error."""


def _driver() -> ModuleType:
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise DriverError(f"cuda.bindings is not installed ({exc}); it ships with CUDA builds of torch") from exc
    return driver


def _proc(symbol: str, version: int, proto: Callable[[int], Callable[..., int]]) -> Callable[..., int]:
    drv = _driver()
    try:
        err, ptr, _status = drv.cuGetProcAddress(symbol.encode(), version, 0)
    except Exception as exc:  # noqa: BLE001 - bindings raise when libcuda itself is missing
        raise DriverError(f"cuGetProcAddress({symbol}) unavailable: {exc}") from exc
    if err != drv.CUresult.CUDA_SUCCESS or not ptr:
        raise DriverError(f"cuGetProcAddress({symbol}, {version}) failed: {err} (driver too old or no driver)")
    return proto(ptr)


@functools.cache
def batch_memcpy() -> Callable[..., int]:
    """ctypes function for cuMemcpyBatchAsync (12.8 ABI); raises DriverError when the driver lacks it."""
    return _proc("cuMemcpyBatchAsync", _BATCH_ABI_VERSION, BATCH_FN)


@functools.cache
def memcpy_async() -> Callable[..., int]:
    """ctypes function for cuMemcpyAsync (UVA pointers; direction inferred by the driver)."""
    return _proc("cuMemcpyAsync", _MEMCPY_ABI_VERSION, MEMCPY_FN)


def check(result: int, what: str) -> None:
    if result != 0:
        raise DriverError(f"{what} returned CUresult {result}")


def host_device_pointer(host_ptr: int) -> int | None:
    """The device address of registered (pinned) host memory at host_ptr, or None when it is not registered."""
    drv = _driver()
    err, dptr = drv.cuPointerGetAttribute(drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_POINTER, host_ptr)
    if err != drv.CUresult.CUDA_SUCCESS:
        return None
    return int(dptr)
