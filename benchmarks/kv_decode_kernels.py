"""One layer's decode attention per KV-cache dtype on the GPU: the backend's whole step, the decode kernel, a tile sweep.

    python benchmarks/kv_decode_kernels.py --dtypes auto fp8 --out $OUT/kv-decode-a.json
    python benchmarks/kv_decode_kernels.py --dtypes turbo4 turbo8 --out $OUT/kv-decode-b.json
    TRITON_INTERPRET=1 python benchmarks/kv_decode_kernels.py --check     # the script's cases on a CPU, untimed

A case is one Llama-3-8B layer (32 query / 8 KV heads of 128, bf16) decoding one request of
``--contexts`` tokens (the new one included) from a cache of 16-token pages in shuffled order,
filled as ``framework.kv_quant`` stores it. Timed inside CUDA graphs (``common.graph_time``) with
``max_seq_len`` the model's length (``--max-model-len``), as the engine's decode graph runs them:

- ``step``: ``TritonAttentionBackend.forward`` (turbo: the rotations of query, key, value and
  output; the quantized store; the decode kernel and its reduce), what one layer adds to a step;
- ``kernel``: ``decode_attention`` alone at its defaults, and the cache's bytes over that time;
- at the longest context, the kernel over block_n x num_warps x num_stages x programs per SM
  (the split count ``num_kv_splits`` aims for); a setting whose output is off from the default's
  by more than 2 % of its largest value, or that cannot launch, is reported, not timed.

Prints each result as it comes and the best setting per dtype; ``--out`` writes the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import os
import time

import torch
import triton
from common import graph_time, write_kernel_report
from fw_triton_attention.backend import TritonAttentionBackend
from fw_triton_attention.decode import decode_attention, decode_tiles, num_kv_splits
from fw_triton_attention.kv_store import store_kv
from fw_triton_attention.quant_tiles import FORMAT_CODES

from framework import kv_quant
from framework.attention_backend import AttentionLayerConfig
from framework.testing.attention import _step_metadata, allocate_test_cache

BLOCK_N = (64, 128, 256)
NUM_WARPS = (4, 8)
NUM_STAGES = (2, 3)
PROGRAMS_PER_SM = (2, 4, 8)
PAGE = 16


def make_case(kv_dtype: str, context: int, max_model_len: int, heads: tuple[int, int, int], device: str, seed: int):
    """The layer, backend, filled cache, step metadata and the step's q/k/v of one case."""
    num_heads, num_kv_heads, head_size = heads
    layer = AttentionLayerConfig(num_heads, num_kv_heads, head_size, head_size**-0.5)
    backend = TritonAttentionBackend()
    backend.initialize([layer], torch.bfloat16, PAGE, torch.device(device))
    generator = torch.Generator().manual_seed(seed)
    pages = -(-context // PAGE)
    cache = allocate_test_cache(backend, layer, kv_dtype, torch.bfloat16, pages + 1, PAGE, device)
    table = torch.randperm(pages + 1, generator=generator)[:pages]
    positions = torch.arange(context - 1)
    slots = (table[positions // PAGE] * PAGE + positions % PAGE).to(device)
    keys, values = (torch.randn(context - 1, num_kv_heads, head_size, generator=generator) for _ in range(2))
    keys, values = keys.to(device, torch.bfloat16), values.to(device, torch.bfloat16)
    if cache.is_quantized:
        kv_quant.store_quantized(cache, keys, values, slots)
    else:
        store_kv(keys, values, cache.data, slots)
    _, metadata = _step_metadata({0: (context - 1, context)}, [table.tolist()], PAGE, device)
    metadata = dataclasses.replace(metadata, max_seq_len=max(context, max_model_len))
    step = [torch.randn(1, n * head_size, generator=generator) for n in (num_heads, num_kv_heads, num_kv_heads)]
    return layer, backend, cache, metadata, [x.to(device, torch.bfloat16) for x in step]


def kernel_call(cache, metadata, query, **tiles):
    """``decode_attention`` over the cache as the backend calls it (the step's row already stored)."""
    return lambda: decode_attention(
        query,
        cache if cache.is_quantized else cache.data,
        metadata.seq_lens,
        metadata.block_table,
        num_reqs=1,
        max_seq_len=metadata.max_seq_len,
        sm_scale=query.shape[-1] ** -0.5,
        fp32_math=False,
        **tiles,
    )


def sweep_settings(key_format: int, context: int, num_kv_heads: int, max_seq_len: int, num_sms: int):
    """The sweep's settings (tiles and the split count they give), defaults first; surplus splits skipped."""
    block_n, warps, programs = decode_tiles(key_format, 128)
    default = dict(block_n=block_n, num_warps=warps, num_stages=2, programs_per_sm=programs)
    grid = itertools.product(BLOCK_N, NUM_WARPS, NUM_STAGES, PROGRAMS_PER_SM)
    settings = [default] + [
        dict(block_n=n, num_warps=w, num_stages=s, programs_per_sm=p)
        for n, w, s, p in grid
        if (n, w, s, p) != tuple(default.values())
    ]
    for setting in settings:
        splits = num_kv_splits(1, num_kv_heads, max_seq_len, num_sms, setting["programs_per_sm"])
        if splits <= triton.cdiv(context, setting["block_n"]) or setting is default:
            yield setting, splits


def run_dtype(args, kv_dtype: str, device: str, time_it) -> list[dict]:
    results = []
    heads = (args.heads, args.kv_heads, 128)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 8
    for context in args.contexts:
        layer, backend, cache, metadata, (query, key, value) = make_case(
            kv_dtype, context, args.max_model_len, heads, device, context
        )
        view = (1, layer.num_heads, layer.head_size)
        backend.prepare(metadata)
        step_s = time_it(functools.partial(backend.forward, layer, query, key, value, cache, metadata))
        rotated = query.view(view)  # as the backend passes it: turbo dtypes rotated, in float32
        if cache.is_quantized and cache.spec.rotate_keys:
            rotated = kv_quant.rotate(rotated, cache.rotation_signs)
        expected = kernel_call(cache, metadata, rotated)()
        kernel_s = time_it(kernel_call(cache, metadata, rotated))
        cache_bytes = cache.spec.bytes_per_token * context  # the rows and their scales
        row = dict(kv_dtype=kv_dtype, context=context, step_us=step_s * 1e6, kernel_us=kernel_s * 1e6)
        row["kernel_gb_s"] = cache_bytes / kernel_s / 1e9 if kernel_s else None
        say(
            f"{kv_dtype:>7} {context:>6}: step {row['step_us']:8.1f} us, kernel {row['kernel_us']:8.1f} us"
            + (f" ({row['kernel_gb_s']:.0f} GB/s)" if row["kernel_gb_s"] else "")
        )
        if context == max(args.contexts) and not args.no_sweep:
            row["sweep"] = sweep(args, cache, metadata, rotated, expected, context, num_sms, time_it)
        results.append(row)
    return results


def sweep(args, cache, metadata, rotated, expected, context, num_sms, time_it) -> list[dict]:
    key_format = FORMAT_CODES[cache.spec.key_format] if cache.is_quantized else 0
    timed = []
    settings = list(sweep_settings(key_format, context, args.kv_heads, metadata.max_seq_len, num_sms))
    for setting, splits in settings[: args.sweep_limit]:
        tiles = dict(block_n=setting["block_n"], num_warps=setting["num_warps"], num_stages=setting["num_stages"])
        entry = {**setting, "num_splits": splits}
        try:
            out = kernel_call(cache, metadata, rotated, num_splits=splits, **tiles)()
            error = ((out.float() - expected.float()).abs().max() / expected.float().abs().max()).item()
            if error > 0.02:
                entry["refused"] = f"off by {error:.3f} of the largest output"
            else:
                entry["us"] = time_it(kernel_call(cache, metadata, rotated, num_splits=splits, **tiles)) * 1e6
        except Exception as failure:  # noqa: BLE001 - out of shared memory and the like: report it
            entry["refused"] = f"{type(failure).__name__}: {str(failure)[:120]}"
        timed.append(entry)
        if "us" in entry and entry["us"]:
            say(f"    {entry}")
    refused = [e for e in timed if "refused" in e]
    say(f"    {len(timed)} settings run, {len(refused)} refused" + "".join(f"\n      {e}" for e in refused))
    best = min((e for e in timed if e.get("us")), key=lambda e: e["us"], default=None)
    if best:
        say(f"    best: {best}")
    return timed


def say(line: str) -> None:
    print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["auto", "fp8", "turbo8", "turbo4"])
    parser.add_argument("--contexts", nargs="+", type=int, default=[128, 32768])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=32768 + 1024, help="the graph's max_seq_len (splits)")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--sweep-limit", type=int, help="time only the first N settings of the sweep (defaults first)")
    parser.add_argument("--check", action="store_true", help="CPU: small cases, run and checked, not timed")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.check:
        if os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("--check runs the kernels under the interpreter: set TRITON_INTERPRET=1")
        args.contexts, args.heads, args.kv_heads, args.max_model_len = [40, 300], 4, 2, 512
        args.sweep_limit = 3
        device, time_it = "cpu", lambda fn: (fn(), 0.0)[1]
    else:
        device, time_it = "cuda", graph_time
    started = time.perf_counter()
    results = [row for kv_dtype in args.dtypes for row in run_dtype(args, kv_dtype, device, time_it)]
    say(f"{len(results)} cases in {time.perf_counter() - started:.0f} s")
    if args.out:
        write_kernel_report(
            args.out, results, max_model_len=args.max_model_len, heads=args.heads, kv_heads=args.kv_heads
        )


if __name__ == "__main__":
    main()
