"""vLLM 0.34's loads while the running batch is full, measured: `--max-num-inflight-kv-loads` with and without the
connector's `may_load_async` (offload_bench/sim/full_batch.py: two decoders hold both running slots, requests return
with a 2,000-token prefix in the CPU tier). Steps of vLLM's real scheduler; no time model.

    .venv-vllm034/bin/offload-connector async-loads [--returning 2] [--json F]
"""

from __future__ import annotations

import dataclasses
import json
import sys

from offload_bench.args import OneLineParser, fail, int_in
from offload_bench.platform import use_cpu_platform


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="offload-connector async-loads", description=__doc__.split("\n\n")[0])
    p.add_argument("--returning", type=int_in(1, 8), default=2, metavar="1..8")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    p.check_output("--json", args.json)  # before the run, not after
    use_cpu_platform()
    import vllm

    from offload_bench.sim import full_batch

    from offload_bench.sim.vllm_compat import has_inflight_load_cap

    if not has_inflight_load_cap():
        return fail(p.prog, f"--max-num-inflight-kv-loads needs vLLM >= 0.34 (this is {vllm.__version__})")
    rows = []
    for inflight in (None, 1, 2, 4):
        for override in (False, True):
            if inflight is None and override:
                continue  # without the cap vLLM never asks
            r = full_batch.run(override, inflight, returning=args.returning)
            rows.append(dataclasses.asdict(r))
            print(f"inflight cap {inflight!s:>4}  may_load_async {'ours' if override else 'vLLM default':>12}: "
                  f"first load after {r.first_load_step} steps, first tokens after {r.first_token_steps} steps, "
                  f"{r.loaded_tokens:,} tokens loaded, {r.not_started} not started, drained {r.drained}",
                  flush=True)
    print(f"vLLM {vllm.__version__}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"vllm": vllm.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
