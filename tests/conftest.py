import os
import sys

# Scheduler tests run vLLM on CPU with local model configs only.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests import session_env  # noqa: E402,F401  (the environment before any test adds to it)


import logging  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture
def caplog(caplog):
    """pytest's caplog, also fed by the connector's loggers: they hang below vLLM's `vllm` logger
    (`offload_connector.log`), which does not propagate to the root logger where caplog listens."""
    ours = logging.getLogger("vllm.offload_connector")
    ours.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        ours.removeHandler(caplog.handler)
