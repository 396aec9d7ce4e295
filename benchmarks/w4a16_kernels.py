"""The W4A16 / W8A16 Triton core (``fw_gptq.kernels.wna16``) against bf16 cuBLAS, Llama-3-8B shapes.

    python benchmarks/w4a16_kernels.py                      # table; JSON to $OUT/w4a16_kernels.json if $OUT is set
    python benchmarks/w4a16_kernels.py --variants gptq4 gptq8 awq4 --rows 1 [--sweep]   # the one-row GEMVs
    python benchmarks/w4a16_kernels.py --sweep --layers down --rows 16 --out sweep.json
    python benchmarks/w4a16_kernels.py --tiny               # the script itself on a CPU (TRITON_INTERPRET=1)
    python benchmarks/w4a16_kernels.py --moe [--tokens 1 8 64 512] [--sweep]   # the MoE kernel: quant_moe_kernels.py
    python benchmarks/w4a16_kernels.py --moe --variants nvfp4 mxfp4          # the FP4 MoE kernel (fw_fp4)
    python benchmarks/w4a16_kernels.py --variants nvfp4 [--sweep]     # the FP4 dense kernels: fp4_kernels.py

For each variant (4-bit group 128 symmetric: GPTQ; with zero points: AWQ; act-order; 8-bit; NVFP4 and
MXFP4 through ``fw_fp4``), layer
(fused qkv, o, fused gate_up, down, LM head) and row count (1..512) it checks the kernel against
``x @ W^T`` on the dequantized weight, then times, replayed from a CUDA graph over copies of the
weight that fill several times the L2 (every call reads HBM, as a decode step does): the kernel at
its heuristic setting (``choose_config``), and bf16 cuBLAS on the dense matrix. At one row it also
times the integer GEMV (``fw_gptq.kernels.gemv_int8``, the one-row default on CUDA unless
``FW_GPTQ_GEMV=tile``) against its own reference (x rounded to int8 per 32 inputs), and after each
variant prints a Llama-3-8B layer's four GEMVs (qkv + o + gate_up + down) and the head. ``--sweep``
also times a grid of settings and reports the fastest: at one row a few integer-GEMV candidates (to
fill ``gemv_int8.GEMV_TUNED``), at more rows the tile kernel's block sizes / split-K / warps (to fit
``choose_config`` to).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from common import copies_timer, time_kernel_settings, write_kernel_report  # noqa: E402
from fw_gptq.kernels.gemv_int8 import GemvConfig, gemv_setting, int8_gemv_supported, quantize_x_reference  # noqa: E402
from fw_gptq.kernels.gemv_int8 import int8_gemv as int8_gemv_kernel  # noqa: E402
from fw_gptq.kernels.layout import dequantize_kernel_weight, to_kernel_layout  # noqa: E402
from fw_gptq.kernels.wna16 import choose_config, wna16_matmul  # noqa: E402
from fw_gptq.packing import IntWeight  # noqa: E402

LAYERS = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "head": (128256, 4096),
}
TINY_LAYERS = {"qkv": (96, 256), "down": (64, 512)}
#: name -> (bits, group size, zero points, act-order)
VARIANTS = {
    "gptq4": (4, 128, False, False),
    "awq4": (4, 128, True, False),
    "gptq4-act": (4, 128, False, True),
    "gptq8": (8, 128, False, False),
}
#: fw_fp4's formats (``fp4_kernels.py``), timed with the same keys
FP4_VARIANTS = ("nvfp4", "mxfp4")
ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
COLD_BYTES = 512 * 2**20  # weight copies each timing cycles through: several times the H200's L2


def random_weight(n: int, k: int, bits: int, group: int, zeros: bool, act_order: bool, device: str, dtype) -> IntWeight:
    generator = torch.Generator(device).manual_seed(n + k)
    q = torch.randint(0, 2**bits, (k, n), device=device, generator=generator, dtype=torch.int32).to(torch.uint8)
    scales = 1e-3 + 1e-3 * torch.rand(k // group, n, device=device, generator=generator)
    zero = (
        torch.randint(0, 2**bits, (k // group, n), device=device, generator=generator, dtype=torch.int32).to(
            torch.uint8
        )
        if zeros
        else None
    )
    g_idx = None
    if act_order:
        perm = torch.randperm(k, device=device, generator=generator)
        g_idx = torch.empty(k, dtype=torch.int64, device=device)
        g_idx[perm] = torch.arange(k, device=device) // group
    return IntWeight(q, scales, zero, g_idx, bits, group)


def sweep_settings(rows: int) -> list[dict]:
    """The grid ``--sweep`` times: 16-row tiles and long K steps for the GEMV rows, 32 / 64-row tiles above
    (the fused kernel; from ``DEQUANT_MIN_ROWS`` rows the default is dequantize + cuBLAS, timed as the rule)."""
    if rows <= 16:
        grid = itertools.product([16], (128, 256), (256, 512, 1024), (1, 2, 4), (4, 8), (4,))
    else:
        grid = itertools.product([32 if rows <= 32 else 64], (128, 256), (128, 256), (1, 2, 4), (4, 8), (3,))
    return [
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk, "num_warps": w, "num_stages": s}
        for bm, bn, bk, sk, w, s in grid
    ]


def measure(variant: str, n: int, k: int, rows: int, sweep: bool, tiny: bool) -> dict:
    if variant in FP4_VARIANTS:
        from fp4_kernels import measure_fp4

        return measure_fp4(variant, n, k, rows, sweep, tiny)
    device, dtype = ("cpu", torch.float32) if tiny else ("cuda", torch.bfloat16)
    bits, group, zeros, act_order = VARIANTS[variant]
    weight = to_kernel_layout(random_weight(n, k, bits, group, zeros, act_order, device, dtype), dtype)
    dense = dequantize_kernel_weight(weight, dtype)
    x = torch.randn(rows, k, device=device, dtype=dtype)
    expected = x.double() @ dense.double().t()
    rule = choose_config(rows, n, k, group, bits=bits)
    tile = rule if rows <= 16 else None  # forced: one row would otherwise go to the integer GEMV
    error = ((wna16_matmul(x, weight, config=tile).double() - expected).abs().max() / expected.abs().max()).item()
    if error > (1e-4 if tiny else 2e-2):
        raise AssertionError(f"{variant} {rows}x{k} @ [{n}, {k}]: relative error {error:.3g}")
    packed_bytes = sum(t.nbytes for t in (weight.qweight, weight.scales, weight.zeros, weight.g_idx) if t is not None)
    copies = [weight] + [
        weight._replace(qweight=weight.qweight.clone())
        for _ in range(0 if tiny else -(-COLD_BYTES // packed_bytes) - 1)
    ]
    dense_copies = [dense] + [dense.clone() for _ in range(0 if tiny else -(-COLD_BYTES // dense.nbytes) - 1)]
    time_it = copies_timer(tiny)
    kernel_s = time_it(lambda w: wna16_matmul(x, w, config=tile), copies)
    cublas_s = time_it(lambda w: torch.nn.functional.linear(x, w), dense_copies)
    result = {
        "variant": variant,
        "n": n,
        "k": k,
        "rows": rows,
        "packed_bytes": packed_bytes,
        "check_rel_error": error,
        "rule": rule,
        "kernel_us": kernel_s * 1e6,
        "kernel_gb_s": packed_bytes / kernel_s / 1e9,
        "cublas_bf16_us": cublas_s * 1e6,
        "speedup_vs_bf16": cublas_s / kernel_s,
    }
    if rows == 1 and int8_gemv_supported(weight):  # the integer GEMV (FW_GPTQ_GEMV=int8), its own rounding
        result.update(int8_gemv(x, weight, copies, time_it, sweep))
    if sweep and rows > 1:
        run = lambda w, config: wna16_matmul(x, w, config=config)  # noqa: E731
        result.update(time_kernel_settings(run, sweep_settings(rows), expected, copies, time_it, packed_bytes))
    return result


#: ``--sweep``'s integer-GEMV candidates ``(block_n, step, num_warps)``, each at split-K 1, 2, 4 and 8
GEMV_CANDIDATES = [(16, 1024, 4), (32, 1024, 4), (64, 1024, 4), (32, 512, 8)]


def int8_gemv(x, weight, copies, time_it, sweep: bool) -> dict:
    """Time the one-row integer GEMV (its default setting, and with ``sweep`` the candidates) against its reference."""
    if weight.perm is not None:  # act-order: the kernel takes x in its (sorted) input order, as wna16_matmul gives it
        x = x.index_select(1, weight.perm)
    dense = dequantize_kernel_weight(weight, torch.float32, permuted=True)
    expected = quantize_x_reference(x).double() @ dense.double().t()
    got = int8_gemv_kernel(x, weight).double()
    error = ((got - expected).abs().max() / expected.abs().max()).item()
    if error > 2e-2:
        raise AssertionError(f"int8 GEMV {weight.in_features} -> {weight.out_features}: relative error {error:.3g}")
    packed = sum(t.nbytes for t in (weight.qweight, weight.scales, weight.zeros) if t is not None)
    seconds = time_it(lambda w: int8_gemv_kernel(x, w), copies)
    setting = gemv_setting(weight, x.device)
    out = {
        "int8_gemv_us": seconds * 1e6,
        "int8_gemv_gb_s": packed / seconds / 1e9,
        "int8_gemv_rel_error": error,
        "int8_gemv_setting": setting._asdict(),
    }
    if sweep:
        grid = []
        k = weight.in_features
        for (block_n, step, warps), split_k in itertools.product(GEMV_CANDIDATES, (1, 2, 4, 8)):
            if k % step or k // step < split_k:
                continue
            config = GemvConfig(block_n, step, split_k, warps)
            run = functools.partial(int8_gemv_kernel, config=config)
            if (run(x, weight).double() - expected).abs().max() > 0.05 * expected.abs().max():
                raise AssertionError(f"int8 GEMV at {config}: wrong result")
            grid.append({**config._asdict(), "us": time_it(lambda w, run=run: run(x, w), copies) * 1e6})
        if grid:  # none where K has no candidate's step (the --tiny shapes)
            out["int8_gemv_best"] = min(grid, key=lambda g: g["us"])
            out["int8_gemv_settings"] = grid
    return out


def layer_sums(results: list[dict]) -> None:
    """Print, per variant timed at one row on all five layers, a layer's four GEMVs and the head (µs)."""
    for variant in dict.fromkeys(r["variant"] for r in results):
        one = {r["layer"]: r for r in results if r["variant"] == variant and r["rows"] == 1}
        if set(one) != set(LAYERS) or "int8_gemv_us" not in one["qkv"]:
            continue
        for key in ("int8_gemv_us", "kernel_us", "cublas_bf16_us"):
            layer = sum(one[name][key] for name in ("qkv", "o", "gate_up", "down"))
            print(f"{variant:10s} {key:15s} qkv+o+gate_up+down {layer:7.1f} us   head {one['head'][key]:7.1f} us")
        if "int8_gemv_best" in one["qkv"]:
            layer = sum(one[name]["int8_gemv_best"]["us"] for name in ("qkv", "o", "gate_up", "down"))
            print(
                f"{variant:10s} {'int8 best':15s} qkv+o+gate_up+down {layer:7.1f} us   head {one['head']['int8_gemv_best']['us']:7.1f} us"
            )
    print(flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    variants = [*VARIANTS, *FP4_VARIANTS]
    parser.add_argument("--variants", nargs="+", default=variants, choices=variants)
    parser.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    parser.add_argument("--rows", type=int, nargs="+", default=ROWS)
    parser.add_argument("--sweep", action="store_true", help="also time a grid of settings per case")
    parser.add_argument("--tiny", action="store_true", help="small shapes on the CPU under the interpreter")
    parser.add_argument("--moe", action="store_true", help="the MoE kernel at the Qwen3-30B-A3B shape instead")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512], help="--moe: token counts")
    parser.add_argument(
        "--moe-shape",
        default="qwen3-30b-a3b",
        choices=["qwen3-30b-a3b", "gpt-oss-20b"],
        help="--moe: the layer (gpt-oss-20b: 32 experts top-4, 2880 x 2880, with its biases and clamped SwiGLU)",
    )
    parser.add_argument("--out", help="the JSON report (default: $OUT/w4a16_kernels.json or w4a16_moe.json)")
    args = parser.parse_args()
    if args.out is None and os.environ.get("OUT"):
        args.out = os.path.join(os.environ["OUT"], "w4a16_moe.json" if args.moe else "w4a16_kernels.json")
    if args.moe:
        from quant_moe_kernels import run_moe

        return run_moe(args, "fp4" if set(args.variants) <= set(FP4_VARIANTS) else "wna16")
    tiny = args.tiny or not torch.cuda.is_available()
    layers = TINY_LAYERS if tiny else {name: LAYERS[name] for name in args.layers}
    rows_list = [1, 3, 17] if tiny else args.rows
    results = []
    print(
        f"{'variant':10s} {'layer':8s} {'N':>6s} {'K':>6s} {'rows':>4s} {'kernel us':>10s} {'GB/s':>7s} "
        f"{'bf16 cuBLAS us':>14s} {'x bf16':>7s} {'best us':>8s}",
        flush=True,
    )
    for variant, (name, (n, k)), rows in itertools.product(args.variants, layers.items(), rows_list):
        result = {"layer": name, **measure(variant, n, k, rows, args.sweep, tiny)}
        results.append(result)
        best = f"{result['best']['us']:8.1f}" if "best" in result else "-"
        if "exact_gemv_us" in result:
            best += f"  float GEMV {result['exact_gemv_us']:.1f} us"
        if "int8_gemv_us" in result:
            best += f"  int8 GEMV {result['int8_gemv_us']:.1f} us ({result['int8_gemv_gb_s']:.0f} GB/s)"
            if "int8_gemv_best" in result:
                g = result["int8_gemv_best"]
                best += f", best {g['us']:.1f} at block_n={g['block_n']} step={g['step']} split_k={g['split_k']} warps={g['num_warps']}"
        print(
            f"{variant:10s} {name:8s} {n:6d} {k:6d} {rows:4d} {result['kernel_us']:10.1f} {result['kernel_gb_s']:7.0f} "
            f"{result['cublas_bf16_us']:14.1f} {result['speedup_vs_bf16']:7.2f} {best:>8s}",
            flush=True,
        )
        if not tiny:
            torch.cuda.empty_cache()
    layer_sums(results)
    if args.out:
        write_kernel_report(args.out, results, tiny=tiny)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
