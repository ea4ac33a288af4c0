"""The process environment vLLM needs to run its scheduler on a machine without a GPU.

vLLM resolves its platform on first import; without these it fails to infer a device or reaches for the hub. Entry
points (the command line, the benchmark scripts) call `use_cpu_platform()` before anything imports vLLM; importing a
module of this package changes nothing.
"""

import os


def use_cpu_platform() -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
