"""Replay benchmarks: workloads through vLLM's real scheduler with simulated model steps and transfers.

Modules, one job each: `trace` (Mooncake-format loading and validation, prompt tokens), `workloads` (built-in
workloads), `timemodel` (step and transfer time), `engines` (timed copy engines), `connectors` (one scheduler per
connector, instrumented), `metrics` (what is measured), `runner` (the replay loop), `pool_dump` (stall dumps),
`table`, `plots`, `command` (the `offload-connector replay` command), `router` (several engines behind a round-robin
router, with private CPU tiers and with the shared tier: `replay --engines 2`).
"""

# The connectors a replay can compare (see connectors.py); here so the command line can list them without vLLM.
CONNECTORS = ("offload", "offload-vllm-reservation", "vllm-offloading", "vllm-offloading-patched", "none")
# Engines behind the router (`replay --engines`, router.py); here for the same reason.
MAX_ENGINES = 8
