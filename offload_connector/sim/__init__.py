"""Simulation on CPU: vLLM's real scheduler and KV cache manager with a simulated model and copy engine."""

import os

# vLLM resolves its platform on first import; without these it fails to infer a device or reaches for the hub.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
