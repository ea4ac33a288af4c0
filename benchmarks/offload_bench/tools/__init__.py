"""The benchmarks and harnesses beyond replay, soak and stall-demo, each an `offload-connector` subcommand.

A tool is a module here with `main(argv) -> int` that parses its own arguments (with `offload_bench.args`, so a bad
one is one line and exit status 2); `TOOLS` names it once, and `offload-connector NAME --help` says the rest.
"""

from __future__ import annotations

import importlib
from typing import Callable

# command -> (module under offload_bench.tools, one line for `offload-connector --help`)
TOOLS: dict[str, tuple[str, str]] = {
    "layout-sweep": ("layout_sweep", "the replay on generated layouts, every workload, worst case per metric"),
    "fuzz-ledger": ("fuzz_ledger", "the ledger's predictions against vLLM's real allocations on random layouts"),
    "soak-all": ("soak", "the soak on both models, one table"),
    "contention": ("contention", "the real-engine equality tests, N times under CPU load"),
    "starved-load": ("starved_load", "a deferred load behind a stream of small requests: steps to its first token"),
    "async-loads": ("async_loads", "vLLM 0.34's may_load_async with --max-num-inflight-kv-loads, on and off"),
    "replay-ratios": ("replay_ratios", "ratios of one connector over another from replay JSON files"),
    "sched-overhead": ("sched_overhead", "the scheduler side's time per step against vLLM's connector"),
    "load-path": ("load_path", "the files one real load enters"),
    "transfer-bench": ("transfer_bench", "copy backends on a GPU: correctness and bandwidth"),
    "overlap-bench": ("overlap_bench", "copies beside compute on a GPU"),
    "cpu-copy-bench": ("cpu_copy_bench", "the host copier against the torch reference on CPU"),
    "verify-bench": ("verify_bench", "the cost of verify_loads' checksums"),
    "disk-bench": ("disk_bench", "the disk tier against raw sequential disk bandwidth"),
    "mac-bench": ("mac_bench", "the second tiers' MAC against the CRC alone"),
}


def tool_main(name: str) -> Callable[[list[str]], int]:
    return importlib.import_module(f"offload_bench.tools.{TOOLS[name][0]}").main
