"""Simulation on CPU: vLLM's real scheduler and KV cache manager with a simulated model and copy engine.

Entry points call `offload_bench.platform.use_cpu_platform()` before vLLM is imported."""
