"""The environment the test session started with (imported first by conftest.py).

In-process vLLM imports and configs add to `os.environ` as tests run (LOCAL_WORLD_SIZE=1, LD_PRELOAD of libgomp,
VLLM_WORKER_MULTIPROC_METHOD, TORCHINDUCTOR_*, ...). Engine and store subprocesses start from this snapshot instead:
inherited, LOCAL_WORLD_SIZE=1 made a later pipeline stage of a PP engine skip its warm-up ("a later pipeline stage
has no intermediate-tensor buffer"), so the full suite skipped every PP layout that runs fine on its own."""

from __future__ import annotations

import os

BASE: dict[str, str] = dict(os.environ)
