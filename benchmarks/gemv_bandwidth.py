"""Decode-sized matmuls (a few rows against one layer's weight) on the GPU: cuBLAS against a Triton GEMV.

    python benchmarks/gemv_bandwidth.py --shape llama3-8b qwen3-32b --tp 1 2 --rows 1 8 --out $OUT/gemv.json
    python benchmarks/gemv_bandwidth.py --check     # the Triton kernel against F.linear (CPU: TRITON_INTERPRET=1)

A batch-1 decode step is its weight reads (the Llama-3-8B shape streams 15 GB per token). This measures, for every
linear layer of a shape as one tensor-parallel rank holds it (fused QKV, O, fused gate/up, down,
LM head), the weight bytes per second of ``F.linear`` (cuBLAS), of the best setting of the
triton_ops plugin's split-K GEMV (``fw_triton_ops.gemv``, the kernel registry's ``linear`` op
``triton``) and of the setting its rule picks (what the engine runs for a shape that the GPU's
table, ``fw_triton_ops.gemv_tuned``, does not list; the table is this sweep's best), each replayed from a CUDA graph (no launch overhead) over copies of
the weight that fill several times the L2 (every call reads from HBM, as in a decode step), and the whole
step's weight time with each.
"""

from __future__ import annotations

import argparse
import itertools

import torch
from common import COPY_BANDWIDTH, SHAPES, graph_time, write_kernel_report
from fw_triton_ops.gemv import GemvConfig, gemv, gemv_config

from framework.distributed.partition import attention_heads_per_rank


def layer_shapes(shape: str, tp: int) -> list[tuple[str, int, int, int]]:
    """``(name, N, K, count per token)`` of each linear weight one rank holds for ``shape`` at ``tp``."""
    c = SHAPES[shape]
    hidden, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = c.get("head_dim", hidden // heads)
    per_rank = attention_heads_per_rank(heads, kv_heads, tp)
    return [
        ("qkv", (per_rank.num_heads + 2 * per_rank.num_kv_heads) * head_dim, hidden, layers),
        ("o", hidden, heads // tp * head_dim, layers),
        ("gate_up", 2 * inter // tp, hidden, layers),
        ("down", hidden, inter // tp, layers),
        ("lm_head", -(-c["vocab_size"] // tp), hidden, 1),
    ]


SETTINGS = [
    GemvConfig(block_n, block_k, split_k, warps, tensor_cores=tensor_cores)
    for block_n, block_k, split_k, warps, tensor_cores in itertools.product(
        (32, 64, 128), (128, 256), (1, 2, 4), (4, 8), (False, True)
    )
]
#: Bytes of weight copies each timing cycles through: several times the H200's 50 MB L2, so every
#: call reads its weight from HBM, as a decode step does (each layer's weight is read once per step).
COLD_BYTES = 512 * 2**20


def measure(n: int, k: int, rows: int) -> dict:
    """cuBLAS, the best Triton setting and the rule's setting for one ``[rows, k] @ [n, k]^T`` (bf16):
    seconds and weight TB/s (a setting that is the rule's own is timed once)."""
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5
    x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
    copies = [w] + [w.clone() for _ in range(-(-COLD_BYTES // w.nbytes) - 1)]
    repeats = max(20, len(copies))

    def cold(run):
        """``run(weight)`` on the next copy each call: the graph replays ``repeats`` calls, all from HBM."""
        calls = itertools.cycle(copies)
        return graph_time(lambda: run(next(calls)), repeats=repeats)

    cublas = cold(lambda weight: torch.nn.functional.linear(x, weight))
    reference = torch.nn.functional.linear(x, w).float()
    rule = gemv_config(n, k, rows, torch.cuda.get_device_properties(0).multi_processor_count)
    times: dict[GemvConfig, float] = {}
    for config in {*SETTINGS, rule}:
        if config.split_k > 1 and k // config.split_k < config.block_k or config.tensor_cores and rows > 1:
            continue
        error = (gemv(x, w, None, config).float() - reference).abs().max().item()
        if error > 0.05 * reference.abs().max().item():  # a wrong kernel must not win: report it, time the rest
            print(f"  WRONG: gemv {rows}x{k} @ {n}x{k} at {config}: error {error:.3g}")
            continue
        times[config] = cold(lambda weight, config=config: gemv(x, weight, None, config))
    best = min(times, key=times.get, default=None)  # None: every setting wrong, cuBLAS alone
    weight_bytes = n * k * 2
    triton_s, rule_s = times.get(best, float("inf")), times.get(rule, float("inf"))
    return {
        "n": n,
        "k": k,
        "rows": rows,
        "weight_bytes": weight_bytes,
        "cublas_us": cublas * 1e6,
        "cublas_tb_s": weight_bytes / cublas / 1e12,
        "triton_us": triton_s * 1e6,
        "triton_tb_s": weight_bytes / triton_s / 1e12,
        "triton_setting": best and best._asdict(),
        "rule_us": rule_s * 1e6,
        "rule_tb_s": weight_bytes / rule_s / 1e12,
        "rule_setting": rule._asdict(),
        "settings": [{**config._asdict(), "us": seconds * 1e6} for config, seconds in sorted(times.items())],
    }


def check() -> None:
    """The plugin's GEMV equals ``F.linear`` on odd sizes, every split (runs under TRITON_INTERPRET=1 on a CPU)."""
    cuda = torch.cuda.is_available()  # bf16 there; fp32 on a CPU (the interpreter computes bf16 wrongly)
    dtype, tolerance = (torch.bfloat16, 2e-2) if cuda else (torch.float32, 1e-4)
    generator = torch.Generator().manual_seed(0)
    for rows, n, k, split_k, tensor_cores in [
        (1, 40, 96, 1, False),
        (1, 72, 200, 2, False),
        (1, 72, 200, 2, True),
        (3, 72, 200, 2, False),
        (8, 33, 130, 4, False),
        (5, 64, 64, 1, False),
    ]:
        x = torch.randn(rows, k, generator=generator).to("cuda" if cuda else "cpu", dtype)
        w = torch.randn(n, k, generator=generator).to(x.device, dtype)
        config = GemvConfig(block_n=32, block_k=32, split_k=split_k, num_warps=4, tensor_cores=tensor_cores)
        got = gemv(x, w, None, config).float()
        expected = torch.nn.functional.linear(x.float(), w.float())
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())
    print("fw_triton_ops.gemv matches F.linear")


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
        step = {"cublas_s": 0.0, "best_s": 0.0, "rule_s": 0.0, "bytes": 0}
        for name, n, k, count in layer_shapes(shape, tp):
            result = {"shape": shape, "tp": tp, "layer": name, **measure(n, k, rows)}
            results.append(result)
            step["cublas_s"] += count * result["cublas_us"] / 1e6
            step["best_s"] += count * min(result["cublas_us"], result["triton_us"]) / 1e6
            step["rule_s"] += count * result["rule_us"] / 1e6
            step["bytes"] += count * result["weight_bytes"]
            print(
                f"{shape} tp{tp} rows {rows} {name:8s} {n:6d}x{k:6d}: cuBLAS {result['cublas_tb_s']:.2f} TB/s, "
                f"Triton {result['triton_tb_s']:.2f} TB/s {result['triton_setting']}, "
                f"rule {result['rule_tb_s']:.2f} TB/s {result['rule_setting']}",
                flush=True,
            )
        print(
            f"{shape} tp{tp} rows {rows}: weights {step['bytes'] / 1e9:.1f} GB in {step['cublas_s'] * 1e3:.2f} ms "
            f"with cuBLAS ({step['bytes'] / step['cublas_s'] / 1e12:.2f} TB/s), {step['rule_s'] * 1e3:.2f} ms with the "
            f"Triton op's rule, {step['best_s'] * 1e3:.2f} ms taking the faster per layer; copy bandwidth "
            f"{COPY_BANDWIDTH / 1e12:.2f} TB/s"
        )
    if args.out:
        write_kernel_report(args.out, results)


if __name__ == "__main__":
    main()
