"""The host tier's memory: one block-first arena (num_slots, slot_bytes), pinned by registration when asked.

Pinning registers an anonymous mmap with `cudaHostRegister` instead of using torch's pinned allocator, which rounds
every allocation up to a power of two (20.4 GiB became 32 GiB in SGLang). Registration goes in chunks of at most
64 GiB (large single registrations fail on some drivers) and is rolled back as a whole if any chunk fails; the
tier then stays pageable with one warning, and `HostTier.pinned` says which it got.
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass, field

import torch

from offload_connector.log import get_logger

logger = get_logger("offload_connector.kernels")

REGISTER_CHUNK_BYTES = 64 << 30
# Portable (every context) | Mapped (device-addressable). UVA implies both for most allocations, but the kernel
# backend dereferences host pages from the GPU, so ask for the mapping explicitly rather than rely on the default.
_CUDA_HOST_REGISTER_FLAGS = 0x01 | 0x02


@dataclass
class HostTier:
    """A (num_slots, slot_bytes) uint8 arena. `close()` unregisters it; the memory is freed with the last view."""

    tensor: torch.Tensor
    pinned: bool
    _mmap: "mmap.mmap | None" = field(default=None, repr=False)
    _registered: list[tuple[int, int]] = field(default_factory=list, repr=False)

    @property
    def num_slots(self) -> int:
        return int(self.tensor.shape[0])

    @property
    def slot_bytes(self) -> int:
        return int(self.tensor.shape[1])

    def close(self) -> None:
        """Unregister the pinned ranges (idempotent). Views taken earlier stay valid as pageable memory."""
        if self._registered:
            cudart = torch.cuda.cudart()
            for ptr, _ in reversed(self._registered):
                cudart.cudaHostUnregister(ptr)
            self._registered = []
        self.pinned = False


def _register(ptr: int, nbytes: int, chunk_bytes: int) -> tuple[list[tuple[int, int]], str | None]:
    """Register [ptr, ptr + nbytes) in chunks; on failure unregister what was done and return the reason."""
    done: list[tuple[int, int]] = []
    try:
        if not torch.cuda.is_available():
            return [], "no CUDA device is available"
        cudart = torch.cuda.cudart()
        off = 0
        while off < nbytes:
            n = min(chunk_bytes, nbytes - off)
            err = cudart.cudaHostRegister(ptr + off, n, _CUDA_HOST_REGISTER_FLAGS)
            code = getattr(err, "value", err)
            if code != 0:
                raise RuntimeError(f"cudaHostRegister({n} bytes at offset {off}) returned error {err}")
            done.append((ptr + off, n))
            off += n
        return done, None
    except Exception as exc:  # noqa: BLE001 - any failure means "not pinned"; the reason goes into the warning
        try:
            cudart = torch.cuda.cudart()
            for p, _ in reversed(done):
                cudart.cudaHostUnregister(p)
        except Exception:  # noqa: BLE001 - rollback is best effort once registration already failed
            pass
        return [], str(exc)


def allocate_host_tier(num_slots: int, slot_bytes: int, *, pin: bool,
                       register_chunk_bytes: int = REGISTER_CHUNK_BYTES) -> HostTier:
    """Allocate the host tier arena.

    Both: an anonymous mmap, page aligned, with transparent huge pages advised (a random page gather then misses
    the TLB once per 2 MiB instead of once per 4 KiB; measured on the CPU backend's 16 KiB pages: about +0.1 of
    memmove speed). pin=True also registers it with CUDA, falling back to pageable memory with a warning when
    registration fails; pin=False (vLLM's CPU backend) leaves it pageable.
    """
    for name, value in (("num_slots", num_slots), ("slot_bytes", slot_bytes),
                        ("register_chunk_bytes", register_chunk_bytes)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    nbytes = num_slots * slot_bytes
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # THP disabled: 4 KiB pages cost registration time and TLB misses, nothing else
    # torch.frombuffer keeps `mm` alive for as long as any view of the arena exists.
    flat = torch.frombuffer(mm, dtype=torch.uint8)
    tensor = flat.view(num_slots, slot_bytes)
    if not pin:
        return HostTier(tensor=tensor, pinned=False, _mmap=mm)
    registered, why = _register(tensor.data_ptr(), nbytes, register_chunk_bytes)
    if why is not None:
        logger.warning("offload_connector: pinning the %d-byte host tier failed (%s); using pageable memory, "
                       "host<->device copies will be slower", nbytes, why)
        return HostTier(tensor=tensor, pinned=False, _mmap=mm)
    return HostTier(tensor=tensor, pinned=True, _mmap=mm, _registered=registered)
