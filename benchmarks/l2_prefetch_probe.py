"""Probe: does prefetching a layer's weight into L2 while HBM is idle speed up its GEMV? (H200)

    python benchmarks/l2_prefetch_probe.py --shape llama3-8b qwen3-32b --tp 2 --out $OUT/l2-prefetch.json

A batch-1 decode step alternates weight-streaming GEMMs with short kernels that leave HBM nearly
idle: attention over a short context, the all-reduces, the norms (Qwen3-32B at TP=2 spends about
1.7 ms of a 10.8 ms step there). If a side stream prefetched the next GEMM's weight into L2 during
such a window, the GEMM would read it at L2 speed. H200's L2 holds 50 MB, more than one rank's
QKV or O weight at TP=2. This probe measures whether that works before any engine code relies on it.

Every case is a CUDA graph replayed many times, each repeat on a different copy of the weight
(enough copies that none is still in L2 from an earlier repeat):

    window          the window alone: ``--window-calls`` Triton decode-attention calls (batch 1,
                    128-token context, the shape's per-rank heads), about what one layer leaves idle
    gemv            ``F.linear`` (cuBLAS) of one row on a cold weight
    serial          window, then gemv
    overlap/<how>   window on the main stream while a side stream prefetches the weight (its first
                    ``--max-mb``, as the engine does), join, gemv
    hot/<how>       prefetch, then gemv, one stream (minus "prefetch" alone: the GEMV from L2)

``<how>`` is a method of the ``prefetch_to_l2`` op (``fw_triton_ops.prefetch``), issued from
``--programs`` programs: ``load`` (loads kept in L2 with ``evict_last``) or ``bulk``
(``cp.async.bulk.prefetch.L2``, Hopper's fire-and-forget bulk prefetch). ``overlap`` well below
``serial`` means the engine should prefetch (``FW_PREFETCH_WEIGHTS``, see
``framework.layers.weight_prefetch``); ``overlap`` near ``serial`` means it should not bother.
"""

from __future__ import annotations

import argparse

import torch
from common import SHAPES, graph_time, write_kernel_report
from fw_triton_ops.prefetch import prefetch_to_l2
from gemv_bandwidth import layer_shapes

from framework.distributed.partition import attention_heads_per_rank
from framework.layers.weight_prefetch import DEFAULT_MB

L2_BYTES = 50 * 2**20  # H200


def prefetcher(how: str, programs: int, max_bytes: int):
    """A function ``(weight) -> None`` that brings the first ``max_bytes`` of ``weight`` into L2 with
    ``how``, as ``FW_PREFETCH_WEIGHTS=how:MB`` has the engine do."""
    def prefetch(weight: torch.Tensor) -> None:
        prefetch_to_l2(weight, max_bytes, how, programs)
    return prefetch


def attention_window(shape: str, tp: int, calls: int):
    """``calls`` Triton decode-attention calls at batch 1 over 128 tokens with a rank's heads of ``shape``."""
    from fw_triton_attention.decode import decode_attention

    c = SHAPES[shape]
    head_dim = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
    heads = attention_heads_per_rank(c["num_attention_heads"], c["num_key_value_heads"], tp)
    page, blocks = 16, 16
    cache = torch.randn(2, blocks, page, heads.num_kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    query = torch.randn(1, heads.num_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    seq_lens = torch.tensor([128], dtype=torch.int32, device="cuda")
    table = torch.arange(blocks, dtype=torch.int32, device="cuda")[None]
    out = torch.empty_like(query)

    def window() -> None:
        for _ in range(calls):
            decode_attention(query, cache, seq_lens, table, num_reqs=1, max_seq_len=128, sm_scale=head_dim ** -0.5,
                             out=out)
    return window


def probe_layer(name: str, n: int, k: int, window, programs: int, max_bytes: int, side: torch.cuda.Stream) -> dict:
    """Microseconds per repeat of every case for one ``[n, k]`` weight (see the module docstring)."""
    copies = max(4, -(-3 * L2_BYTES // (n * k * 2)))
    weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    turn = [0]

    def next_weight() -> torch.Tensor:
        turn[0] += 1
        return weights[turn[0] % copies]

    def gemv() -> None:
        torch.nn.functional.linear(x, next_weight())

    def serial() -> None:
        window()
        gemv()

    cases = {"window": window, "gemv": gemv, "serial": serial}
    for how in ("load", "bulk"):
        prefetch = prefetcher(how, programs, max_bytes)

        def overlap(prefetch=prefetch) -> None:
            weight = next_weight()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                prefetch(weight)
            window()
            torch.cuda.current_stream().wait_stream(side)
            torch.nn.functional.linear(x, weight)

        def hot(prefetch=prefetch) -> None:
            weight = next_weight()
            prefetch(weight)
            torch.nn.functional.linear(x, weight)

        cases[f"prefetch/{how}"] = lambda prefetch=prefetch: prefetch(next_weight())
        cases[f"overlap/{how}"] = overlap
        cases[f"hot/{how}"] = hot
    result: dict = {"layer": name, "n": n, "k": k, "weight_mb": n * k * 2 / 1e6, "copies": copies}
    for case, fn in cases.items():
        try:
            result[case + "_us"] = graph_time(fn, repeats=copies * 2) * 1e6
        except Exception as error:  # e.g. the bulk prefetch's PTX on an older chip: report, keep going
            result[case + "_error"] = f"{type(error).__name__}: {error}"[:300]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", nargs="+", default=["llama3-8b", "qwen3-32b"], choices=sorted(SHAPES))
    parser.add_argument("--tp", type=int, nargs="+", default=[2])
    parser.add_argument("--layers", nargs="+", default=["qkv", "o", "down"])
    parser.add_argument("--programs", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--window-calls", type=int, default=2, help="decode-attention calls in one window")
    parser.add_argument("--max-mb", type=float, default=DEFAULT_MB,
                        help="the most one prefetch brings in (the engine's FW_PREFETCH_WEIGHTS=METHOD:MB)")
    parser.add_argument("--out")
    args = parser.parse_args()
    side = torch.cuda.Stream()
    results = []
    for shape in args.shape:
        for tp in args.tp:
            window = attention_window(shape, tp, args.window_calls)
            for name, n, k, _count in layer_shapes(shape, tp):
                if name not in args.layers:
                    continue
                for programs in args.programs:
                    result = {"shape": shape, "tp": tp, "programs": programs,
                              **probe_layer(name, n, k, window, programs, int(args.max_mb * 2**20), side)}
                    results.append(result)
                    times = "  ".join(f"{key[:-3]} {value:.1f}" for key, value in result.items() if key.endswith("_us"))
                    print(f"{shape} tp{tp} {name} {n}x{k} ({result['weight_mb']:.0f} MB) programs {programs}: {times} us",
                          flush=True)
                    for key, value in result.items():
                        if key.endswith("_error"):
                            print(f"  {key}: {value}", flush=True)
    if args.out:
        write_kernel_report(args.out, results, window_calls=args.window_calls, max_mb=args.max_mb)


if __name__ == "__main__":
    main()
