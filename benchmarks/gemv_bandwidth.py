"""Decode-sized matmuls (a few rows against one layer's weight) on the GPU: cuBLAS against a Triton GEMV.

    python benchmarks/gemv_bandwidth.py --shape llama3-8b qwen3-32b --tp 1 2 --rows 1 8 --out $OUT/gemv.json
    python benchmarks/gemv_bandwidth.py --check     # the Triton kernel against F.linear (CPU: TRITON_INTERPRET=1)

A batch-1 decode step is its weight reads: the Llama-3-8B shape streams 15 GB per token, and
cuBLAS reaches 88 % of the copy bandwidth there (docs/benchmarks.md). This measures, for every
linear layer of a shape as one tensor-parallel rank holds it (fused QKV, O, fused gate/up, down,
LM head), the weight bytes per second of ``F.linear`` (cuBLAS) and of the best setting of a
split-K Triton GEMV defined here, each replayed from a CUDA graph (no launch overhead), and the
whole step's weight time with each. The Triton kernel is a candidate only: it joins the engine
(through the kernel registry) only if this shows it ahead.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import time

import torch
import triton
import triton.language as tl
from common import COPY_BANDWIDTH, SHAPES, command_line, device_name, git_commit

from framework.distributed.partition import attention_heads_per_rank


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                 M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """``out[M, N] (+)= x[M, K] @ w[N, K]^T``: program (block of N, split of K).

    One row (``M_PAD == 1``): multiply-accumulate ``[BLOCK_N, BLOCK_K]`` tiles elementwise, reduce
    once at the end. More rows: pad them to ``M_PAD >= 16`` and use ``tl.dot`` (tensor cores).
    With ``SPLIT_K > 1`` every split adds its partial sums into a zeroed fp32 ``out``.
    """
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    rows = tl.arange(0, M_PAD)
    if M_PAD == 1:
        tiles = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + ks, mask=ks < k_hi, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < k_hi),
                        other=0.0).to(tl.float32)
            tiles += w * x[None, :]
        acc = tl.sum(tiles, axis=1)[None, :]
    else:
        acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < k_hi),
                        other=0.0)
            w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < k_hi),
                        other=0.0)
            acc += tl.dot(x, tl.trans(w))
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offsets = rows[:, None] * stride_om + cols[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out_ptr + offsets, acc, mask=mask)


def triton_gemv(x: torch.Tensor, w: torch.Tensor, block_n: int = 64, block_k: int = 256, split_k: int = 1,
                num_warps: int = 4, num_stages: int = 4, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T`` for a few rows of ``x``; with ``split_k > 1`` the sums gather in fp32 ``out`` (zeroed here)."""
    m, k = x.shape
    n = w.shape[0]
    m_pad = 1 if m == 1 else max(16, triton.next_power_of_2(m))
    if split_k == 1:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    else:
        out = torch.zeros(m, n, dtype=torch.float32, device=x.device) if out is None else out.zero_()
    grid = (triton.cdiv(n, block_n), split_k)
    _gemv_kernel[grid](x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0), M_PAD=m_pad, BLOCK_N=block_n,
                       BLOCK_K=block_k, SPLIT_K=split_k, num_warps=num_warps, num_stages=num_stages)
    return out if split_k == 1 else out.to(x.dtype)


def layer_shapes(shape: str, tp: int) -> list[tuple[str, int, int, int]]:
    """``(name, N, K, count per token)`` of each linear weight one rank holds for ``shape`` at ``tp``."""
    c = SHAPES[shape]
    hidden, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = c.get("head_dim", hidden // heads)
    per_rank = attention_heads_per_rank(heads, kv_heads, tp)
    return [("qkv", (per_rank.num_heads + 2 * per_rank.num_kv_heads) * head_dim, hidden, layers),
            ("o", hidden, heads // tp * head_dim, layers),
            ("gate_up", 2 * inter // tp, hidden, layers),
            ("down", hidden, inter // tp, layers),
            ("lm_head", -(-c["vocab_size"] // tp), hidden, 1)]


def graph_time(fn, repeats: int = 20, rounds: int = 5) -> float:
    """Seconds per call of ``fn``, replayed ``repeats`` times inside one CUDA graph (best of ``rounds``)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / repeats)
    return best


SETTINGS = list(itertools.product((32, 64, 128), (128, 256), (1, 2, 4), (4, 8)))  # block_n, block_k, split_k, warps


def measure(n: int, k: int, rows: int) -> dict:
    """cuBLAS and the best Triton setting for one ``[rows, k] @ [n, k]^T`` (bf16): seconds and weight TB/s."""
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k ** 0.5
    x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
    scratch = torch.empty(rows, n, dtype=torch.float32, device="cuda")
    cublas = graph_time(lambda: torch.nn.functional.linear(x, w))
    reference = torch.nn.functional.linear(x, w).float()
    best = None
    for block_n, block_k, split_k, warps in SETTINGS:
        if split_k > 1 and k // split_k < block_k:
            continue
        run = functools.partial(triton_gemv, x, w, block_n, block_k, split_k, warps,
                                out=scratch if split_k > 1 else None)
        error = (run().float() - reference).abs().max().item()
        if error > 0.05 * reference.abs().max().item():  # a wrong kernel must not win: report it, time the rest
            print(f"  WRONG: triton_gemv {rows}x{k} @ {n}x{k} at {(block_n, block_k, split_k, warps)}: error {error:.3g}")
            continue
        seconds = graph_time(run)
        if best is None or seconds < best[0]:
            best = (seconds, dict(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=warps))
    weight_bytes = n * k * 2
    triton_s, setting = best or (float("inf"), None)  # every setting wrong: cuBLAS alone
    return {"n": n, "k": k, "rows": rows, "weight_bytes": weight_bytes,
            "cublas_us": cublas * 1e6, "cublas_tb_s": weight_bytes / cublas / 1e12,
            "triton_us": triton_s * 1e6, "triton_tb_s": weight_bytes / triton_s / 1e12, "triton_setting": setting}


def check() -> None:
    """The Triton GEMV equals ``F.linear`` on odd sizes, every split (runs under TRITON_INTERPRET=1 on a CPU)."""
    cuda = torch.cuda.is_available()  # bf16 there; fp32 on a CPU (the interpreter computes bf16 wrongly)
    dtype, tolerance = (torch.bfloat16, 2e-2) if cuda else (torch.float32, 1e-4)
    generator = torch.Generator().manual_seed(0)
    for rows, n, k, split_k in [(1, 40, 96, 1), (1, 72, 200, 2), (3, 72, 200, 2), (8, 33, 130, 4), (5, 64, 64, 1)]:
        x = torch.randn(rows, k, generator=generator).to("cuda" if cuda else "cpu", dtype)
        w = torch.randn(n, k, generator=generator).to(x.device, dtype)
        got = triton_gemv(x, w, block_n=32, block_k=32, split_k=split_k).float()
        expected = torch.nn.functional.linear(x.float(), w.float())
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())
    print("triton_gemv matches F.linear")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", nargs="+", default=["llama3-8b", "qwen3-32b"], choices=sorted(SHAPES))
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--check", action="store_true", help="only check the kernel against F.linear")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.check:
        check()
        return
    results = []
    for shape, tp, rows in itertools.product(args.shape, args.tp, args.rows):
        step = {"cublas_s": 0.0, "best_s": 0.0, "bytes": 0}
        for name, n, k, count in layer_shapes(shape, tp):
            result = {"shape": shape, "tp": tp, "layer": name, **measure(n, k, rows)}
            results.append(result)
            step["cublas_s"] += count * result["cublas_us"] / 1e6
            step["best_s"] += count * min(result["cublas_us"], result["triton_us"]) / 1e6
            step["bytes"] += count * result["weight_bytes"]
            print(f"{shape} tp{tp} rows {rows} {name:8s} {n:6d}x{k:6d}: cuBLAS {result['cublas_tb_s']:.2f} TB/s, "
                  f"Triton {result['triton_tb_s']:.2f} TB/s {result['triton_setting']}", flush=True)
        print(f"{shape} tp{tp} rows {rows}: weights {step['bytes'] / 1e9:.1f} GB in {step['cublas_s'] * 1e3:.2f} ms "
              f"with cuBLAS ({step['bytes'] / step['cublas_s'] / 1e12:.2f} TB/s), {step['best_s'] * 1e3:.2f} ms taking "
              f"the faster per layer; copy bandwidth {COPY_BANDWIDTH / 1e12:.2f} TB/s")
    if args.out:
        report = {"date": time.strftime("%Y-%m-%d"), "device": device_name(), "commit": git_commit(),
                  "command": command_line(),
                  "torch": torch.__version__, "triton": triton.__version__, "results": results}
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
