"""Short-context decode attention on the GPU: store_kv + decode_attention against the fused store, and a tile sweep.

    python benchmarks/decode_attention_sweep.py --out $OUT/decode_attention_sweep.json
    python benchmarks/decode_attention_sweep.py --shape qwen3-32b --batch 1 --context 128   # one case
    TRITON_INTERPRET=1 python benchmarks/decode_attention_sweep.py --check    # the script's kernels on a CPU

A case is one layer's decode attention as a tensor-parallel rank runs it: ``--batch`` requests of
``--context`` tokens each (the new token included), the rank's heads of ``--shape`` at ``--tp``
(Llama-3-8B TP=2: 16 query / 4 KV heads; Qwen3-32B TP=2: 32 / 4; head 128), a bf16 cache of
16-token pages in shuffled order. Timed inside CUDA graphs (``common.graph_time``), as the
engine's decode graph runs them:

- ``unfused``: ``store_kv`` then ``decode_attention`` (what a decode layer ran before the fused store),
- ``fused``: ``decode_attention`` with the step's new K/V (what it runs now),

both at the engine's defaults: tiles of ``decode_attention``, split count of
``num_kv_splits(batch, kv_heads, max_model_len)`` (inside the graph ``max_seq_len`` is the model's
context length, ``--max-model-len``, default the shape's ``max_position_embeddings``). Then the
fused kernel over block_n x num_warps x num_stages x num_splits; settings whose splits outnumber
the context's tiles (only empty segments added) are skipped, as are those the GPU cannot run (out
of shared memory), and a setting whose output differs from the unfused default is reported, not
timed. Prints the best setting per case next to the default's time; ``--out`` writes the JSON.
"""

from __future__ import annotations

import argparse
import itertools
import os
from typing import Any, NamedTuple

import torch
import triton
from common import SHAPES, graph_time, write_kernel_report
from fw_triton_attention.decode import decode_attention, num_kv_splits
from fw_triton_attention.kv_store import store_kv

from framework.distributed.partition import attention_heads_per_rank

BLOCK_N = (32, 64, 128)
NUM_WARPS = (2, 4, 8)
NUM_STAGES = (1, 2, 3)
NUM_SPLITS = (1, 2, 4, 8)
PAGE = 16


class DecodeCase(NamedTuple):
    """One decode step's tensors for one layer: every request at ``context`` tokens, the last one new."""

    query: torch.Tensor  # [R, H, D]
    key: torch.Tensor  # [R, H_kv, D], the new token's
    value: torch.Tensor
    kv_cache: torch.Tensor  # [2, blocks, PAGE, H_kv, D]
    seq_lens: torch.Tensor  # [R]
    block_table: torch.Tensor  # [R, blocks per request]
    slot_mapping: torch.Tensor  # [R], where the new token goes


def make_case(
    batch: int,
    context: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
) -> DecodeCase:
    """Random inputs of one case; pages shuffled so that neighbouring positions are not neighbours in memory."""
    generator = torch.Generator().manual_seed(seed)
    blocks_per_request = -(-context // PAGE)
    num_blocks = batch * blocks_per_request + 1
    table = torch.randperm(num_blocks, generator=generator)[: batch * blocks_per_request].view(batch, -1)
    last = context - 1
    slots = table[:, last // PAGE] * PAGE + last % PAGE

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    return DecodeCase(
        rand(batch, num_heads, head_size),
        rand(batch, num_kv_heads, head_size),
        rand(batch, num_kv_heads, head_size),
        rand(2, num_blocks, PAGE, num_kv_heads, head_size),
        torch.full((batch,), context, dtype=torch.int32, device=device),
        table.to(device=device, dtype=torch.int32),
        slots.to(device),
    )


def unfused(case: DecodeCase, max_seq_len: int, **tiles: Any) -> torch.Tensor:
    """``store_kv`` then ``decode_attention`` reading the stored token back."""
    store_kv(case.key, case.value, case.kv_cache, case.slot_mapping)
    return decode_attention(
        case.query,
        case.kv_cache,
        case.seq_lens,
        case.block_table,
        num_reqs=len(case.seq_lens),
        max_seq_len=max_seq_len,
        sm_scale=case.query.shape[-1] ** -0.5,
        **tiles,
    )


def fused(case: DecodeCase, max_seq_len: int, **tiles: Any) -> torch.Tensor:
    """``decode_attention`` storing the new K/V itself."""
    return decode_attention(
        case.query,
        case.kv_cache,
        case.seq_lens,
        case.block_table,
        num_reqs=len(case.seq_lens),
        max_seq_len=max_seq_len,
        sm_scale=case.query.shape[-1] ** -0.5,
        key=case.key,
        value=case.value,
        slot_mapping=case.slot_mapping,
        **tiles,
    )


def sweep_settings(context: int) -> list[dict[str, int]]:
    """The grid's settings that give every split at least one tile of the context."""
    return [
        dict(block_n=block_n, num_warps=warps, num_stages=stages, num_splits=splits)
        for block_n, warps, stages, splits in itertools.product(BLOCK_N, NUM_WARPS, NUM_STAGES, NUM_SPLITS)
        if splits <= triton.cdiv(context, block_n)
    ]


def run_case(shape: str, tp: int, batch: int, context: int, max_model_len: int) -> dict[str, Any]:
    """Time one case's unfused and fused defaults and sweep the fused kernel; the result row."""
    config = SHAPES[shape]
    heads = attention_heads_per_rank(config["num_attention_heads"], config["num_key_value_heads"], tp)
    head_size = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    case = make_case(batch, context, heads.num_heads, heads.num_kv_heads, head_size, torch.bfloat16, "cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    default_splits = num_kv_splits(batch, heads.num_kv_heads, max_model_len, sms)
    reference = unfused(case, max_model_len).float()
    row: dict[str, Any] = {
        "shape": shape,
        "tp": tp,
        "batch": batch,
        "context": context,
        "num_heads": heads.num_heads,
        "num_kv_heads": heads.num_kv_heads,
        "head_size": head_size,
        "max_model_len": max_model_len,
        "kv_bytes": 2 * batch * context * heads.num_kv_heads * head_size * 2,
        "default_num_splits": default_splits,
        "store_kv_us": graph_time(lambda: store_kv(case.key, case.value, case.kv_cache, case.slot_mapping)) * 1e6,
        "unfused_us": graph_time(lambda: unfused(case, max_model_len)) * 1e6,
        "fused_us": graph_time(lambda: fused(case, max_model_len)) * 1e6,
        "sweep": [],
        "skipped": [],
    }
    for setting in sweep_settings(context):
        try:
            error = (fused(case, max_model_len, **setting).float() - reference).abs().max().item()
        except triton.runtime.errors.OutOfResources as exc:  # e.g. 3 stages of 128-key tiles: shared memory
            row["skipped"].append({**setting, "reason": str(exc)})
            continue
        if error > 2e-2 * max(reference.abs().max().item(), 1.0):  # a wrong kernel must not win
            print(f"  WRONG: {setting}: max error {error:.3g}")
            row["skipped"].append({**setting, "reason": f"max error {error:.3g}"})
            continue
        row["sweep"].append({**setting, "us": graph_time(lambda s=setting: fused(case, max_model_len, **s)) * 1e6})
    row["best"] = min(row["sweep"], key=lambda r: r["us"]) if row["sweep"] else None
    return row


def describe(row: dict[str, Any]) -> str:
    """The case's lines of the printed summary."""
    best = row["best"]
    best_text = (
        "none ran"
        if best is None
        else (
            f"{best['us']:.1f} us at block_n {best['block_n']}, {best['num_warps']} warps, {best['num_stages']} stages, "
            f"{best['num_splits']} splits ({row['kv_bytes'] / best['us'] / 1e3:.0f} GB/s of K/V)"
        )
    )
    return (
        f"{row['shape']} tp{row['tp']} ({row['num_heads']}/{row['num_kv_heads']} heads) batch {row['batch']} "
        f"context {row['context']}:\n"
        f"  default ({row['default_num_splits']} splits): store_kv {row['store_kv_us']:.1f} us + decode = "
        f"{row['unfused_us']:.1f} us unfused, {row['fused_us']:.1f} us fused\n"
        f"  best of {len(row['sweep'])} fused settings: {best_text}"
    )


def check() -> None:
    """The script's two paths on tiny shapes: same output, same cache, for the default and swept
    settings (on a CPU under TRITON_INTERPRET=1, fp32: the interpreter computes bf16 wrongly)."""
    cuda = torch.cuda.is_available()
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--check on a CPU runs the kernels under Triton's interpreter: set TRITON_INTERPRET=1")
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    for batch, context, heads, kv_heads in [(1, 40, 4, 2), (3, 33, 8, 2)]:
        settings = [{}] + [
            s for s in sweep_settings(context) if s["block_n"] == 32 and s["num_stages"] == 2 and s["num_warps"] == 4
        ]
        for setting in settings:
            base, tested = (make_case(batch, context, heads, kv_heads, 32, dtype, device) for _ in range(2))
            expected = unfused(base, 4096, **setting)
            got = fused(tested, 4096, **setting)
            assert torch.equal(tested.kv_cache, base.kv_cache), f"caches differ at {setting}"
            torch.testing.assert_close(got, expected, rtol=0, atol=2e-2 if cuda else 0)
    print("decode_attention with the new K/V matches store_kv + decode_attention")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", nargs="+", default=["llama3-8b", "qwen3-32b"], choices=sorted(SHAPES))
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=int, nargs="+", default=[128, 512, 4096])
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the engine's context length, which sets the graph's split count (default: the shape's)",
    )
    parser.add_argument("--check", action="store_true", help="only check fused against unfused on tiny shapes")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.check:
        check()
        return
    if not torch.cuda.is_available():
        parser.error("the sweep times kernels on a CUDA GPU; on a CPU run --check")
    results = []
    for shape, batch, context in itertools.product(args.shape, args.batch, args.context):
        max_model_len = args.max_model_len or SHAPES[shape]["max_position_embeddings"]
        results.append(run_case(shape, args.tp, batch, context, max_model_len))
        print(describe(results[-1]), flush=True)
    if args.out:
        write_kernel_report(args.out, results)


if __name__ == "__main__":
    main()
