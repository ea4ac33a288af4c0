"""GPU <-> host copy kernels for paged KV blocks, with the torch reference path.

Lives at the repository's top-level `kernels/` and is imported as `offload_connector.kernels` (a symlink in the
source tree, a regular subpackage in the wheel). Never imports the scheduler side.
"""
