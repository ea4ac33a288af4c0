"""The connector's loggers: children of vLLM's `vllm` logger, so their lines appear in the server output.

vLLM configures only the `vllm` logger (its handler, format and `VLLM_LOGGING_LEVEL`, or the user's
`VLLM_LOGGING_CONFIG_PATH`) and does not propagate it to the root logger; a plain `logging.getLogger("offload_connector")`
has no handler there, so its INFO lines were lost and its warnings came out unformatted through Python's last-resort
handler. `get_logger(__name__)` returns vLLM's logger (`vllm.logger.init_logger`, with its `*_once` methods) named
`vllm.offload_connector.<module>`, which inherits all of that. Without vLLM installed (a kernel benchmark on a bare
machine) it is a plain logger of the same name.
"""

from __future__ import annotations

import logging

LOGGER_PREFIX = "vllm."  # vLLM's own logger is "vllm"; ours hang below it


def get_logger(module: str) -> logging.Logger:
    """The logger for `module` (pass `__name__`): `vllm.offload_connector.…`."""
    name = module if module.startswith(LOGGER_PREFIX) else LOGGER_PREFIX + module
    try:
        from vllm.logger import init_logger
    except ImportError:  # pragma: no cover - vLLM is installed wherever the connector runs
        return logging.getLogger(name)
    return init_logger(name)
