"""The unit layer: the connector's modules on their own, with fakes (or a local store server), in seconds; the inner
loop (`pytest tests/unit` or `pytest -m unit`).

Every test collected under this directory gets the `unit` marker (registered in pyproject.toml)."""

from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(items):
    for item in items:
        if _HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.unit)
