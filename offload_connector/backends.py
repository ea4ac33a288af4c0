"""The copy backends the worker can use, in one place: the config key `transfer_backend` accepts these names and
`offload_connector.kernels.select` builds them from here.

Plain data (no torch, no CUDA), so the scheduler side and the config parser can read it. A new backend is one module
under `kernels/` (the package `offload_connector.kernels`) with a `BlockCopier` subclass and one line below.
"""

from __future__ import annotations

# name -> (module under offload_connector.kernels, class, needs CUDA). "auto" is not a backend but a choice among them.
COPY_BACKENDS: dict[str, tuple[str, str, bool]] = {
    "reference": ("reference", "ReferenceCopier", False),
    "kernel": ("cupy_kernel", "KernelCopier", True),
    "batch": ("batch_dma", "BatchCopier", True),
    "per_page": ("per_page", "PerPageCopier", True),
    "host": ("host_copy", "HostCopier", False),
}

BACKEND_CHOICES: tuple[str, ...] = ("auto", *COPY_BACKENDS)
CUDA_BACKENDS: tuple[str, ...] = tuple(name for name, (_, _, cuda) in COPY_BACKENDS.items() if cuda)
# What "auto" falls back to, in order, when the calibrated choice cannot be built (no CuPy, no batched DMA driver).
FALLBACK_ORDER: tuple[str, ...] = ("batch", "per_page", "reference")
