"""Backend choice: `make_copier` builds the named backend, or for "auto" the best one per direction.

"auto" on a CPU device is the compiled host path (`host_copy.py`), or the reference path when no C compiler is
there. On CUDA it runs a short calibration on scratch buffers shaped like the real layout (never on the caller's
pages, which may already hold data), per direction, and keeps the fastest backend, except that the DMA backend
(copy engines, no SMs) is kept unless an SM backend is faster by more than `SM_MARGIN` for that direction: copies run
beside the forward pass, and on an H200 (docs/results/2026-12-04-first-gpu-run.md) the SM kernel took 10 % of a
matmul's throughput while it loaded and 40 % while it stored, the DMA backend 2 %. Stores are never on a request's
critical path, so they need the larger margin; a load is (its request waits), so a clearly faster kernel still wins.
`OFFLOAD_CONNECTOR_COPY_BACKEND` forces a choice for "auto": one backend name, or "h2d=kernel,d2h=batch".
"""
from __future__ import annotations

import importlib
import os
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from offload_connector.backends import BACKEND_CHOICES, COPY_BACKENDS, CUDA_BACKENDS, FALLBACK_ORDER
from offload_connector.log import get_logger
from .api import DIRECTIONS, BlockCopier, Completion
from .reference import ReferenceCopier

logger = get_logger("offload_connector.kernels")

BACKENDS: tuple[str, ...] = BACKEND_CHOICES
ENV_FORCE = "OFFLOAD_CONNECTOR_COPY_BACKEND"
SM_MARGIN: dict[str, float] = {"h2d": 0.25, "d2h": 1.0}  # SM kernel must be 1.25x / 2x faster than DMA
MIN_CALIBRATION_BLOCKS = 8
UNCALIBRATED = "batch"  # the backend when no calibration scratch fits on the device


@dataclass(frozen=True)
class CalibrationConfig:
    """Size of the start-up calibration (scratch memory per direction, timed repetitions)."""

    max_bytes: int = 256 << 20
    max_tensors: int = 8
    max_blocks: int = 256
    repeats: int = 3


def _backend_class(name: str) -> Callable[..., BlockCopier]:
    # Imported on demand: the CUDA backends import CuPy / cuda-python, which a CPU engine does not have.
    if name not in COPY_BACKENDS:
        raise ValueError(f"backend {name!r} is not one of {BACKENDS}")
    module, cls, _ = COPY_BACKENDS[name]
    return getattr(importlib.import_module(f"{__package__}.{module}"), cls)


def parse_forced(value: str) -> dict[str, str]:
    """Parse OFFLOAD_CONNECTOR_COPY_BACKEND: "batch" or "h2d=kernel,d2h=batch" -> {direction: backend}."""
    value = value.strip()
    if "=" not in value:
        if value not in BACKENDS or value == "auto":
            raise ValueError(f"{ENV_FORCE}={value!r}: accepted {BACKENDS[1:]} or 'h2d=NAME,d2h=NAME'")
        return {d: value for d in DIRECTIONS}
    out: dict[str, str] = {}
    for part in value.split(","):
        key, _, name = part.partition("=")
        key, name = key.strip(), name.strip()
        if key not in DIRECTIONS or name not in BACKENDS or name == "auto":
            raise ValueError(f"{ENV_FORCE}: bad entry {part!r}; accepted directions {DIRECTIONS}, "
                             f"backends {BACKENDS[1:]}")
        out[key] = name
    missing = [d for d in DIRECTIONS if d not in out]
    if missing:
        raise ValueError(f"{ENV_FORCE}={value!r} names no backend for {missing}")
    return out


class DirectionalCopier(BlockCopier):
    """Dispatches each direction to its own backend (the result of "auto")."""

    def __init__(self, per_direction: dict[str, BlockCopier]) -> None:
        first = per_direction["h2d"]
        super().__init__(first.device_pages, first.host_pages, first.segments)
        self.per_direction = per_direction
        self.name = f"auto(h2d={per_direction['h2d'].name},d2h={per_direction['d2h'].name})"

    def _copy(self, direction: str, ids: list[tuple[np.ndarray, np.ndarray] | None],
              stream: "torch.cuda.Stream | None") -> Completion:
        return self.per_direction[direction]._copy(direction, ids, stream)

    def close(self) -> None:
        for c in {id(c): c for c in self.per_direction.values()}.values():
            c.close()


def _build(name: str, device_pages: Sequence[torch.Tensor], host_pages: Sequence[torch.Tensor],
           segments: Sequence[Sequence[int]], device: torch.device) -> BlockCopier:
    if name in CUDA_BACKENDS:
        if device.type != "cuda":
            raise RuntimeError(f"backend {name!r} needs a CUDA device, but device is {device}; use 'reference' or "
                               "'auto'")
        if not torch.cuda.is_available():
            raise RuntimeError(f"backend {name!r} needs a CUDA device, but torch sees none (no driver or GPU)")
    if name == "host" and device.type != "cpu":
        raise RuntimeError(f"backend 'host' copies between two host buffers (vLLM's CPU backend), but device is "
                           f"{device}; use 'auto'")
    return _backend_class(name)(device_pages, host_pages, segments)


def _host_or_reference(device_pages: Sequence[torch.Tensor], host_pages: Sequence[torch.Tensor],
                       segments: Sequence[Sequence[int]]) -> BlockCopier:
    from .host_copy import HostCopier, HostCopyUnavailable

    try:
        return HostCopier(device_pages, host_pages, segments)
    except HostCopyUnavailable as exc:
        logger.warning("offload_connector: compiled host copy unavailable (%s); using the reference path, "
                       "about half as fast", exc)
        return ReferenceCopier(device_pages, host_pages, segments)


def make_copier(backend: str, device_pages: Sequence[torch.Tensor], host_pages: Sequence[torch.Tensor],
                segments: Sequence[Sequence[int]], *, device: torch.device,
                calibration: CalibrationConfig = CalibrationConfig()) -> BlockCopier:
    """Build a copier. backend: one of BACKENDS. A named backend that cannot work raises; "auto" falls back."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {BACKENDS}")
    device = torch.device(device)
    if backend != "auto":
        return _build(backend, device_pages, host_pages, segments, device)
    if device.type != "cuda":
        return _host_or_reference(device_pages, host_pages, segments)
    forced = os.environ.get(ENV_FORCE)
    if forced:
        choice = parse_forced(forced)
        logger.info("offload_connector: copy backends forced by %s: %s", ENV_FORCE, choice)
    else:
        choice = calibrate(device_pages, segments, device, calibration)
    built: dict[str, BlockCopier] = {}
    per_direction: dict[str, BlockCopier] = {}
    for d in DIRECTIONS:
        # The calibrated choice can still fail on the real pages (e.g. a host tier that could not be pinned rules
        # out the kernel): fall through DMA batch, per-page DMA, reference, with one warning each.
        for name in dict.fromkeys((choice[d],) + FALLBACK_ORDER):
            if name not in built:
                try:
                    built[name] = _build(name, device_pages, host_pages, segments, device)
                except Exception as exc:  # noqa: BLE001 - "auto" must come up with a working copier
                    logger.warning("offload_connector: copy backend %r unavailable for %s (%s); trying the next",
                                   name, d, exc)
                    continue
            per_direction[d] = built[name]
            break
    return DirectionalCopier(per_direction)


def _scratch_layout(device_pages: Sequence[torch.Tensor], segments: Sequence[Sequence[int]],
                    cfg: CalibrationConfig) -> tuple[list[int], int]:
    """Page sizes of up to cfg.max_tensors tensors of the largest group, and a block count within cfg.max_bytes."""
    seg = max(segments, key=lambda s: sum(int(device_pages[t].shape[1]) for t in s), default=[])
    pages = [int(device_pages[t].shape[1]) for t in list(seg)[:cfg.max_tensors]] or [1]
    per_block = max(1, sum(pages))
    blocks = max(1, min(cfg.max_blocks, cfg.max_bytes // per_block))
    return pages, blocks


def calibrate(device_pages: Sequence[torch.Tensor], segments: Sequence[Sequence[int]], device: torch.device,
              cfg: CalibrationConfig = CalibrationConfig(),
              backends: Sequence[str] = CUDA_BACKENDS) -> dict[str, str]:
    """Time every CUDA backend on scratch pages shaped like the layout; returns {direction: fastest backend}.

    A backend that fails to build or to copy correctly is dropped with one warning; with none left, "reference".
    """
    from .host_tier import allocate_host_tier

    pages, blocks = _scratch_layout(device_pages, segments, cfg)
    # vLLM sizes the KV cache to the memory limit before the connector registers it: the scratch pages may not fit.
    # Fewer blocks time the same backends less precisely; with none fitting, DMA, which needs no device scratch.
    while True:
        try:
            dev = [torch.randint(0, 256, (2 * blocks, p), dtype=torch.uint8, device=device) for p in pages]
            break
        except torch.OutOfMemoryError:
            if blocks <= MIN_CALIBRATION_BLOCKS:
                logger.warning("offload_connector: no device memory for the copy backend calibration (%d bytes); "
                               "using %r without calibrating", 2 * blocks * sum(pages), UNCALIBRATED)
                return {d: UNCALIBRATED for d in DIRECTIONS}
            blocks //= 2
    tiers = [allocate_host_tier(2 * blocks, p, pin=True) for p in pages]
    host = [t.tensor for t in tiers]
    for h in host:
        h.copy_(torch.randint(0, 256, tuple(h.shape), dtype=torch.uint8))
    segs = [list(range(len(pages)))]
    rng = np.random.default_rng(0)
    src = rng.permutation(2 * blocks)[:blocks].astype(np.int64)
    dst = rng.permutation(2 * blocks)[:blocks].astype(np.int64)
    ids = [(src, dst)]
    times: dict[str, dict[str, float]] = {d: {} for d in DIRECTIONS}
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    try:
        for name in backends:
            try:
                copier = _build(name, dev, host, segs, device)
            except Exception as exc:  # noqa: BLE001 - one warning, then the backend is not a candidate
                logger.warning("offload_connector: copy backend %r unavailable (%s)", name, exc)
                continue
            try:
                for d in DIRECTIONS:
                    copier.copy(d, ids, stream).wait()  # warm-up (JIT, first-touch), then checked
                    if not _landed(d, dev, host, src, dst):
                        raise RuntimeError(f"{d} copy did not match the reference")
                    t0 = time.perf_counter()
                    for _ in range(cfg.repeats):
                        copier.copy(d, ids, stream)
                    if stream is not None:
                        stream.synchronize()
                    times[d][name] = (time.perf_counter() - t0) / cfg.repeats
            except Exception as exc:  # noqa: BLE001
                logger.warning("offload_connector: copy backend %r failed during calibration (%s)", name, exc)
                for d in DIRECTIONS:
                    times[d].pop(name, None)
            finally:
                copier.close()
    finally:
        for t in tiers:
            t.close()
    choice = {d: pick_fastest(times[d], margin=SM_MARGIN[d]) for d in DIRECTIONS}
    logger.info("offload_connector: copy backend calibration %s -> %s", times, choice)
    return choice


def _landed(direction: str, dev: list[torch.Tensor], host: list[torch.Tensor], host_ids: np.ndarray,
            dev_ids: np.ndarray) -> bool:
    """True when every copied page equals its source (calibration's correctness gate)."""
    h = torch.from_numpy(host_ids)
    d = torch.from_numpy(dev_ids).to(dev[0].device)
    return all(torch.equal(dt.index_select(0, d).cpu(), ht.index_select(0, h)) for dt, ht in zip(dev, host))


def pick_fastest(seconds: dict[str, float], margin: float, prefer: str = "batch") -> str:
    """The fastest backend; `prefer` (DMA, no SMs used) wins unless another takes under 1 / (1 + margin) of its time."""
    if not seconds:
        return "reference"
    best = min(seconds, key=seconds.__getitem__)
    if prefer in seconds and seconds[prefer] <= seconds[best] * (1 + margin):
        return prefer
    return best
