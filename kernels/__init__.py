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

    _here = _os.path.realpath(__file__)
    _root = _os.path.dirname(_os.path.dirname(_here))
    _spec = _machinery.PathFinder.find_spec(
        "kernels", [p for p in _sys.path if _os.path.realpath(p or _os.getcwd()) != _root])
    if _spec is not None and _spec.origin and _os.path.realpath(_spec.origin) == _here:
        _spec = None  # this directory again, through another path (a second checkout entry): never load it twice
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
