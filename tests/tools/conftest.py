"""The tools layer: the command lines (benchmarks, scripts), the docs, the packaging, the plots and the dashboard
(`pytest tests/tools` or `pytest -m tools`).

Every test collected under this directory gets the `tools` marker (registered in pyproject.toml)."""

from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(items):
    for item in items:
        if _HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.tools)
