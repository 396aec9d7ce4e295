"""One MLA layer's decode attention on the GPU: the Triton latent kernel against the torch reference, and a tile sweep.

    python benchmarks/mla_attention.py --out $OUT/mla_attention.json                 # DeepSeek-V2-Lite heads
    python benchmarks/mla_attention.py --shape glm-4.7-flash --batch 1 --context 4096  # one case
    TRITON_INTERPRET=1 python benchmarks/mla_attention.py --check    # the script's kernels on a CPU

A case is one layer's decode step of ``--batch`` requests of ``--context`` tokens each (the new one
included) over a bf16 ``"mla"`` cache of 16-token pages in shuffled order, with the heads and
latent sizes of ``--shape`` (``num_attention_heads``, ``kv_lora_rank + qk_rope_head_dim``):

- ``torch``: the reference backend's ``forward`` (eager; it loops over requests on the host, so
  it is what MLA models ran before the Triton backend read the layout, without CUDA graphs),
- ``triton``: the Triton backend's ``forward`` (``mla_decode`` storing the new latents), timed
  inside a CUDA graph (``common.graph_time``) with the split count the engine's graph uses
  (``max_seq_len`` = ``--max-model-len``),

then ``mla_decode`` over block_n x num_warps x num_splits (settings whose output differs from the
default are reported, not timed). ``latent_tb_per_s`` is the cached latent bytes read per second.
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from typing import Any

import torch
from common import SHAPES, graph_time, write_kernel_report
from fw_torch_attention.backend import TorchAttentionBackend
from fw_triton_attention.backend import TritonAttentionBackend
from fw_triton_attention.mla_decode import mla_decode

from framework.attention_backend import AttentionLayerConfig, AttentionMetadata, MLAConfig
from framework.kv_cache import KVCache

PAGE = 16
BLOCK_N = (16, 32, 64)
NUM_WARPS = (4, 8)
NUM_SPLITS = (1, 2, 4, 8, 16)
CASES = [(1, 128), (1, 4096), (1, 32768), (64, 128), (64, 4096)]


def make_step(heads: int, rank: int, rope: int, batch: int, context: int, device: str, dtype: torch.dtype):
    """``(layer, query, latent, cache, metadata)`` of one decode step; the new tokens' slots from the table."""
    generator = torch.Generator().manual_seed(batch * 7919 + context)
    size, blocks = rank + rope, -(-context // PAGE)
    layer = AttentionLayerConfig(heads, 1, size, size**-0.5, mla=MLAConfig(rank, rope))
    table = torch.randperm(batch * blocks, generator=generator).to(torch.int32).view(batch, blocks)
    lens = torch.full((batch,), context, dtype=torch.int32)
    slots = table[:, (context - 1) // PAGE].long() * PAGE + (context - 1) % PAGE
    cu = torch.arange(batch + 1, dtype=torch.int32)
    metadata = AttentionMetadata(
        num_reqs=batch,
        num_tokens=batch,
        cu_seqlens_q=cu.to(device),
        seq_lens=lens.to(device),
        block_table=table.to(device),
        slot_mapping=slots.to(device),
        max_query_len=1,
        max_seq_len=context,
        cu_seqlens_q_cpu=cu,
        seq_lens_cpu=lens,
        is_decode_only=True,
        block_table_cpu=table,
    )
    cache = torch.randn(batch * blocks, PAGE, size, generator=generator).to(device, dtype)
    query = torch.randn(batch, heads * size, generator=generator).to(device, dtype)
    latent = torch.randn(batch, size, generator=generator).to(device, dtype)
    return layer, query, latent, cache, metadata


def eager_time(fn, repeats: int = 5) -> float:
    """Seconds per eager call (best of ``repeats``), host launch cost included."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return best


def run_case(shape: str, batch: int, context: int, max_model_len: int) -> dict[str, Any]:
    config = SHAPES[shape]
    heads, rank, rope = config["num_attention_heads"], config["kv_lora_rank"], config["qk_rope_head_dim"]
    layer, query, latent, cache, metadata = make_step(heads, rank, rope, batch, context, "cuda", torch.bfloat16)
    latent_bytes = batch * context * (rank + rope) * cache.element_size()
    torch_backend, triton_backend = TorchAttentionBackend(), TritonAttentionBackend()
    torch_s = eager_time(lambda: torch_backend.forward(layer, query, latent, None, KVCache(cache), metadata))
    metadata.max_seq_len = max_model_len  # as inside the engine's decode graph
    expected = triton_backend.forward(layer, query, latent, None, KVCache(cache), metadata).view(batch, heads, rank)
    triton_s = graph_time(lambda: triton_backend.forward(layer, query, latent, None, KVCache(cache), metadata))
    row = dict(shape=shape, heads=heads, rank=rank, rope=rope, batch=batch, context=context, torch_s=torch_s)
    row |= dict(triton_s=triton_s, latent_tb_per_s=latent_bytes / triton_s / 1e12, max_model_len=max_model_len)
    q = query.view(batch, heads, rank + rope)
    common = dict(rank=rank, num_reqs=batch, max_seq_len=context, sm_scale=layer.scale)
    sweep = []
    for block_n, warps, splits in itertools.product(BLOCK_N, NUM_WARPS, NUM_SPLITS):
        if (splits - 1) * block_n >= context:
            continue  # only empty segments added
        tiles = dict(block_n=block_n, num_warps=warps, num_splits=splits)

        def call(tiles=tiles):
            return mla_decode(q, cache, metadata.seq_lens, metadata.block_table, **tiles, **common)

        try:
            error = (call().float() - expected.float()).abs().max().item()
        except Exception as failure:  # noqa: BLE001 - e.g. out of shared memory: report, keep sweeping
            sweep.append(tiles | {"error": type(failure).__name__})
            continue
        sweep.append(tiles | ({"max_error": error} if error > 2e-2 else {"seconds": graph_time(call)}))
    timed = [s for s in sweep if "seconds" in s]
    row["best"] = min(timed, key=lambda s: s["seconds"]) if timed else None
    row["sweep"] = sweep
    return row


def check() -> None:
    """The script's Triton path against the torch reference on tiny shapes (no timing)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--check on a CPU runs the kernels under Triton's interpreter: set TRITON_INTERPRET=1")
    for batch, context in ((1, 40), (3, 17)):
        layer, query, latent, cache, metadata = make_step(4, 32, 16, batch, context, "cpu", torch.float32)
        reference_cache = cache.clone()
        expected = TorchAttentionBackend().forward(layer, query, latent, None, KVCache(reference_cache), metadata)
        metadata.max_seq_len = 4096
        out = TritonAttentionBackend(num_sms=64).forward(layer, query, latent, None, KVCache(cache), metadata)
        error = (out - expected).abs().max().item()
        assert error < 1e-4 and torch.equal(cache, reference_cache), (batch, context, error)
        print(f"batch {batch} context {context}: triton matches torch (max error {error:.2g})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mla_shapes = sorted(name for name, config in SHAPES.items() if config.get("kv_lora_rank"))
    parser.add_argument("--shape", default="deepseek-v2-lite", choices=mla_shapes)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--context", type=int)
    parser.add_argument("--max-model-len", type=int, default=32768 + 16)
    parser.add_argument("--check", action="store_true", help="only check triton against torch on tiny shapes")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.check:
        check()
        return
    if not torch.cuda.is_available():
        parser.error("the benchmark times kernels on a CUDA GPU; on a CPU run --check")
    cases = [(args.batch, args.context)] if args.batch else CASES
    results = []
    for batch, context in cases:
        row = run_case(args.shape, batch, context, args.max_model_len)
        best = row["best"] or {}
        print(
            f"{args.shape} batch {batch} context {context}: torch {row['torch_s'] * 1e6:,.0f} us, triton "
            f"{row['triton_s'] * 1e6:,.1f} us ({row['latent_tb_per_s']:.2f} TB/s); best tiles {best}",
            flush=True,
        )
        results.append(row)
    if args.out:
        write_kernel_report(args.out, results, shape=args.shape, max_model_len=args.max_model_len)


if __name__ == "__main__":
    main()
