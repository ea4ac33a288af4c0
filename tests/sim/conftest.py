"""The simulation layer: vLLM's real scheduler on CPU driven by the simulator of benchmarks/offload_bench (sim, replay,
soak), no engine (`pytest tests/sim` or `pytest -m sim`).

Every test collected under this directory gets the `sim` marker (registered in pyproject.toml)."""

from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(items):
    for item in items:
        if _HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.sim)
