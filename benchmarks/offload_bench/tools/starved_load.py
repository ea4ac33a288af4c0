"""The starved-load scene (`offload_bench.sim.starved`) under every admission setting, side by side in one run.

    offload-connector starved-load [--json PATH]

Per scene and setting: the step of the returning request's first token after it arrived, whether its prefix was
loaded, how often newer requests were held back for it, the small requests' TTFT p50 / p95 in steps, and the steps
until everything finished. Scenes: the stream is what the load waits for (decoders of 1,000-token prompts, a
300-token request every 2 steps from the start), the same without the stream, and the decoders are what it waits for
(1,500-token prompts, a 100-token request every 3 steps). vLLM 0.33/0.34's real scheduler, tag-checked copies.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

from offload_bench.platform import use_cpu_platform

SCENES = {
    "stream blocks the load": dict(decoder_prompt=1000, decode_tokens=1500, stream_tokens=300, stream_every=2,
                                   stream_count=1000, stream_first=True, max_steps=8000),
    "no stream": dict(decoder_prompt=1000, decode_tokens=1500, stream_tokens=0, max_steps=8000),
    "decoders block the load": dict(decoder_prompt=1500, decode_tokens=600, stream_tokens=100, stream_every=3,
                                    stream_count=1000, stream_first=True, max_steps=8000),
}
SETTINGS = {
    "no connector": None,
    "reservation vllm": ("vllm", {}),
    "exact, greedy": ("exact", {"admission_policy": "greedy"}),
    "exact, fair (default)": ("exact", {}),
    "exact, fair, hold all at once": ("exact", {"fair_hold_after_steps": 0}),
}


def main(argv: list[str] | None = None) -> int:
    from offload_bench.args import OneLineParser
    p = OneLineParser(prog="offload-connector starved-load", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write every outcome here")
    args = p.parse_args(argv)
    p.check_output("--json", args.json)  # before the run, not after
    use_cpu_platform()
    from offload_bench.sim.scenarios import connector_config
    from offload_bench.sim.starved import Scene, run

    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    jobs = [(s, k) for s in SCENES for k in SETTINGS]
    bar = tqdm(total=len(jobs), unit="run", desc="starved-load") if tqdm else None
    results = []
    for scene_name, setting in jobs:
        spec = SETTINGS[setting]
        cfg = None if spec is None else connector_config(spec[0], 1 << 32, **spec[1])
        t0 = time.time()
        drv, out = run(cfg, Scene(**SCENES[scene_name]))
        held = drv.side.counters.held_for_older if drv.side is not None else 0
        results.append({"scene": scene_name, "setting": setting, **asdict(out), "held_for_older": held,
                        "wall_s": round(time.time() - t0, 1)})
        if bar:
            bar.update(1)
    if bar:
        bar.close()
    print("| scene | setting | first token (steps after arrival) | loaded | newer requests held | stream TTFT p50 / p95 "
          "(steps) | steps to drain |")
    print("|---|---|---:|---|---:|---:|---:|")
    for r in results:
        ttft = "-" if r["small_ttft_p50"] is None else f"{r['small_ttft_p50']:.0f} / {r['small_ttft_p95']:.0f}"
        print(f"| {r['scene']} | {r['setting']} | {r['first_token_step']} | {'yes' if r['ret_loaded'] else 'no'} | "
              f"{r['held_for_older']} | {ttft} | {r['steps']}{'' if r['drained'] else ' (not drained)'} |")
    import vllm

    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"vllm": vllm.__version__, "results": results}, fh, indent=1)
    print(f"vLLM {vllm.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
