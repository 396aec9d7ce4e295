"""Sweep the Triton decode-attention kernel's tile settings on the GPU: effective K/V bandwidth.

    python benchmarks/tune_decode_attention.py

For each shape (requests, query heads, KV heads, context) it times ``decode_attention`` over a
paged bf16 cache with shuffled pages, for every (block_n, num_warps, num_stages, splits) in the
grid, and prints GB/s of K/V read (the bytes one step must stream) per setting, best first.
"""

from __future__ import annotations

import itertools

import torch
from fw_triton_attention.decode import decode_attention, num_kv_splits

SHAPES = [  # (name, requests, heads, kv heads, context)
    ("nano-qwen3-0.6b", 256, 16, 8, 1000),
    ("llama3-8b-b64", 64, 32, 8, 4096),
    ("llama3-8b-b1", 1, 32, 8, 4096),
]


def run_shape(name: str, reqs: int, heads: int, kv_heads: int, context: int, page: int = 16, head: int = 128) -> None:
    blocks_per_req = -(-context // page)
    num_blocks = reqs * blocks_per_req + 1
    cache = torch.randn(2, num_blocks, page, kv_heads, head, dtype=torch.bfloat16, device="cuda")
    table = torch.randperm(num_blocks - 1, device="cuda", dtype=torch.int32)[: reqs * blocks_per_req].view(reqs, -1)
    seq_lens = torch.full((reqs,), context, dtype=torch.int32, device="cuda")
    query = torch.randn(reqs, heads, head, dtype=torch.bfloat16, device="cuda")
    kv_bytes = 2 * reqs * context * kv_heads * head * 2
    default_splits = num_kv_splits(reqs, kv_heads, 8192, torch.cuda.get_device_properties(0).multi_processor_count)
    results = []
    for block_n, warps, stages, splits in itertools.product(
        (16, 32, 64), (4, 8), (2, 3), sorted({default_splits, 1, 2, 4})
    ):
        args = dict(
            num_reqs=reqs,
            max_seq_len=8192,
            sm_scale=head**-0.5,
            num_splits=splits,
            block_n=block_n,
            num_warps=warps,
            num_stages=stages,
        )
        try:
            decode_attention(query, cache, seq_lens, table, **args)
            torch.cuda.synchronize()
        except Exception as error:  # out of shared memory for this tile
            results.append((0.0, block_n, warps, stages, splits, type(error).__name__))
            continue
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            decode_attention(query, cache, seq_lens, table, **args)
        stop.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(stop) / 1e3 / 20
        results.append((kv_bytes / seconds / 1e9, block_n, warps, stages, splits, f"{seconds * 1e6:.0f} us"))
    results.sort(reverse=True)
    print(
        f"{name}: {reqs} requests x {context} tokens, {heads}/{kv_heads} heads, {kv_bytes / 1e9:.2f} GB; "
        f"default splits {default_splits}"
    )
    default = [r for r in results if r[1:5] == (64, 4, 2, default_splits)]
    print(f"  default (64, 4 warps, 2 stages, {default_splits} splits): {default[0][0]:.0f} GB/s {default[0][5]}")
    for gbps, block_n, warps, stages, splits, note in results[:6]:
        print(f"  {gbps:7.0f} GB/s  block_n {block_n:3d}  warps {warps}  stages {stages}  splits {splits:2d}  {note}")


if __name__ == "__main__":
    for shape in SHAPES:
        run_shape(*shape)
