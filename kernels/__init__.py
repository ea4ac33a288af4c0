"""GPU <-> host copy kernels for paged KV blocks, with the torch reference path.

A regular subpackage (with its `.cu` and `.c` sources beside it); which backends exist is `offload_connector.backends`.
Never imports the scheduler side, and imports nothing that needs a
GPU, CuPy or a driver: the CUDA backends load those when they are built.
"""

if __name__ == "kernels":
    # Only ever `offload_connector.kernels` (the wheel maps this directory there; in a source checkout, the finder in
    # offload_connector/__init__.py). But a process whose sys.path holds the repository root (tests, scripts, a
    # `vllm serve` started there) also finds it under the top-level name `kernels`, which is Hugging Face's kernels
    # package: transformers probes for that on import, imported this one as it, and with Hugging Face's installed
    # failed to import its API from here (`cannot import name 'CUDAProperties' from 'kernels'`). Under that name this
    # module steps aside: for the next `kernels` on sys.path, or for an empty module transformers reads as absent.
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys
    import types as _types

    def _not_a_checkout(spec: _machinery.ModuleSpec | None) -> bool:
        # This project's kernels/ (this checkout through another path, e.g. a symlink, or another checkout) sits next
        # to offload_connector/: loading one of those under this name would step aside again, without end.
        origin = spec.origin if spec is not None else None
        return spec is not None and not (origin and _os.path.isfile(_os.path.join(
            _os.path.dirname(_os.path.dirname(origin)), "offload_connector", "__init__.py")))

    _spec = next((s for s in (_machinery.PathFinder.find_spec("kernels", [p]) for p in _sys.path if isinstance(p, str))
                  if _not_a_checkout(s)), None)
    if _spec is not None and _spec.loader is not None:
        _other = _util.module_from_spec(_spec)
        _sys.modules["kernels"] = _other  # the import returns what sys.modules holds once this body has run
        _spec.loader.exec_module(_other)
    else:
        _other = _types.ModuleType("kernels", "Not installed: the repository's kernels/ is offload_connector.kernels.")
        _other.__spec__ = _machinery.ModuleSpec("kernels", None)  # find_spec reads it; no __file__, no version
        _sys.modules["kernels"] = _other
else:
    from .api import DIRECTIONS, BlockCopier, Completion, Direction
    from .host_tier import HostTier, allocate_host_tier
    from .reference import ReferenceCopier
    from .select import BACKENDS, CalibrationConfig, make_copier

    __all__ = ["BACKENDS", "DIRECTIONS", "BlockCopier", "CalibrationConfig", "Completion", "Direction", "HostTier",
               "ReferenceCopier", "allocate_host_tier", "make_copier"]
