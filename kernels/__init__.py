"""GPU <-> host copy kernels for paged KV blocks, with the torch reference path.

A regular subpackage (with its `.cu` and `.c` sources beside it); which backends exist is `offload_connector.backends`.
Never imports the scheduler side, and imports nothing that needs a
GPU, CuPy or a driver: the CUDA backends load those when they are built.
"""
from .api import DIRECTIONS, BlockCopier, Completion, Direction
from .host_tier import HostTier, allocate_host_tier
from .reference import ReferenceCopier
from .select import BACKENDS, CalibrationConfig, make_copier

__all__ = ["BACKENDS", "DIRECTIONS", "BlockCopier", "CalibrationConfig", "Completion", "Direction", "HostTier",
           "ReferenceCopier", "allocate_host_tier", "make_copier"]
