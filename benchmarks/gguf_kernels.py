"""GGUF packed-weight kernels on the GPU (``fw_gguf.kernels``) against bf16 cuBLAS on the dequantized weight.

    python benchmarks/gguf_kernels.py --out $OUT/gguf_kernels.json
    python benchmarks/gguf_kernels.py --types Q4_K --layers qkv down --rows 1 --sweep --out $OUT/sweep.json
    python benchmarks/gguf_kernels.py --tiny     # the script itself on a CPU (TRITON_INTERPRET=1)
    python benchmarks/gguf_kernels.py --moe [--tokens 1 8 64 512] [--sweep]   # the MoE kernel: gguf_moe_kernels.py
    python benchmarks/gguf_kernels.py --types Q4_K Q6_K Q8_0 --rows 16 64 512   # MMQ beside the tile kernel
    python benchmarks/gguf_kernels.py --types Q4_K --layers qkv down --rows 64 --sweep   # MMQ tiles

For each type, Llama-3-8B layer shape (fused qkv, o, fused gate_up, down, LM head) and row count,
it first checks the kernels (the dequantize kernel bit-exact in bf16 with the torch reference, the
matmul within bf16 tolerance of ``x @ W^T`` on that reference), then times, each replayed from a
CUDA graph over copies of the weight that fill several times the L2 (every call reads from HBM, as
a decode step does): the matmul at its static setting (``kernel_config``: the TUNED table, else the
rule), what the method
runs from ``DEQUANTIZE_MIN_ROWS`` rows on (the dequantize kernel into a matrix, then cuBLAS), and
cuBLAS on the bf16 matrix; for 2+ rows of Q8_0 / Q4_K / Q6_K also the int8 MMQ
(``fw_gguf.kernels.mmq``, at ``mmq_setting``; ``gguf_matmul``'s default there). Bandwidth is of the packed bytes, also as a fraction of the H200's
copy bandwidth. ``--sweep`` times a grid of settings too, reports the fastest and prints them as
entries for ``fw_gguf.kernels.matmul.TUNED`` (or to fit the rule to); it compiles and times up to
144 settings per case (the 1-row GEMV with x read per row and shared; 108 tile settings at 64 rows,
144 at 512); where the MMQ runs (2+ rows, its types) it sweeps the MMQ's tiles instead (27 at 64
rows, 36 at 512), so narrow it with ``--types``, ``--layers`` and ``--rows`` to fit a run.
``--time-limit`` (default 85 s) stops starting cases and sweep settings past that many seconds
(what was measured is printed and written; the rest is reported skipped). ``--moe``
benchmarks the MoE kernel instead (``gguf_moe_kernels.py``). Weights are random blocks with small fp16 scales (valid for every type).
"""

from __future__ import annotations

import argparse
import itertools
import os
import time

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from common import COPY_BANDWIDTH, graph_time, write_kernel_report  # noqa: E402
from fw_gguf.dequant import dequantize  # noqa: E402
from fw_gguf.kernels.gemv import GemvConfig, gemv_setting, gemv_supported, quantize_x_reference  # noqa: E402
from fw_gguf.kernels.layout import FIELDS, GROUPS, to_planar  # noqa: E402
from fw_gguf.kernels.matmul import (  # noqa: E402
    GGUFKernelConfig,
    gguf_dequantize,
    gguf_matmul,
    kernel_config,
    mmq_setting,
    row_bucket,
)
from fw_gguf.kernels.mmq import MmqConfig, mmq_supported, mmq_takes  # noqa: E402
from fw_gguf.method import DEQUANTIZE_MIN_ROWS  # noqa: E402
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402

#: ``name: (N, K)`` of each Llama-3-8B linear weight (TP 1) and of the --tiny stand-ins.
LAYERS = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "head": (128256, 4096),
}
TINY_LAYERS = {"qkv": (96, 512), "down": (40, 768)}
TYPES = ["Q4_K", "Q6_K", "Q8_0", "Q5_K", "Q4_0"]
#: Bytes of weight copies each timing cycles through: several times the H200's 50 MB L2.
COLD_BYTES = 512 * 2**20
_F16_FIELDS = {qtype: [start for start, size in fields if size == 2] for qtype, fields in FIELDS.items()}


def random_blocks(qtype: GGMLQuantizationType, n: int, k: int, device: str, generator: torch.Generator) -> torch.Tensor:
    """``[n, bytes per row]`` random GGUF blocks, every 2-byte field an fp16 of about 1e-3 (both
    signs): quants random, scales finite, values small. (Q4_1/Q5_1's fp16 min is such a field too.)"""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    total = n * k // block_size
    blocks = torch.randint(0, 256, (total, type_size), dtype=torch.uint8, device=device, generator=generator)
    for start in _F16_FIELDS[qtype]:
        scale = torch.randn(total, 1, device=device, generator=generator) * 1e-3
        blocks[:, start : start + 2] = scale.half().view(torch.uint8)
    return blocks.view(n, -1)


def sweep_settings(qtype: GGMLQuantizationType, rows: int) -> list[GGUFKernelConfig]:
    block_size = GROUPS[qtype][0] * GROUPS[qtype][1]
    steps = (1, 2) if block_size == 256 else (4, 8)
    if rows <= 8:
        block_ms = (1, 16) if rows == 1 else (16,)  # one row: elementwise, or padded onto tensor cores
        return [
            GGUFKernelConfig(block_m, block_n, nb, split_k, warps, stages, shared_x)
            for block_m, block_n, nb, split_k, warps, stages, shared_x in itertools.product(
                block_ms, (16, 32, 64), steps, (1, 2, 4, 8), (4, 8), (3,), (False, True)
            )
            if block_m == 1 or not shared_x
        ]
    # tensor-core tiles: up to 512 values of K per step and K split, as the rule may (108 settings at 64 rows)
    return [
        GGUFKernelConfig(block_m, block_n, nb, split_k, warps, 2)
        for block_m, block_n, nb, split_k, warps in itertools.product(
            (16, 32, 64, 128), (32, 64, 128), steps, (1, 2, 4), (4, 8)
        )
        if block_m <= max(16, triton_next_pow2(rows))
    ]


def gemv_sweep_settings() -> list[GemvConfig]:
    return [
        GemvConfig(block_n, nb, split_k, warps, stages)
        for block_n, nb, split_k, warps, stages in itertools.product(
            (8, 16, 32, 64), (1, 2, 4), (1, 2, 4, 8), (4, 8), (2,)
        )
    ]


def mmq_sweep_settings(rows: int) -> list[MmqConfig]:
    """MMQ tiles: rows per program up to the rows (16..128), 32..128 weight rows, K split 1/2/4; 8 warps
    for the 64 x 128 and larger tiles."""
    return [
        MmqConfig(block_m, block_n, split_k, 8 if block_m * block_n >= 8192 else 4, 2)
        for block_m, block_n, split_k in itertools.product((16, 32, 64, 128), (32, 64, 128), (1, 2, 4))
        if block_m <= max(16, triton_next_pow2(rows))
    ]


def uses_gemv(qtype: GGMLQuantizationType, n: int, k: int, rows: int) -> bool:
    return rows == 1 and gemv_supported(qtype, k, n * k // GGML_QUANT_SIZES[qtype][0])


def uses_mmq(qtype: GGMLQuantizationType, n: int, k: int, rows: int) -> bool:
    """Whether ``gguf_matmul``'s default runs the int8 MMQ here (x rounded as the GEMV rounds it)."""
    return mmq_takes(qtype, rows, k, n * k // GGML_QUANT_SIZES[qtype][0], True)


def triton_next_pow2(value: int) -> int:
    return 1 << (value - 1).bit_length()


def timer(tiny: bool):
    """``time(fn, copies)``: seconds per call of ``fn(copy)`` cycling through ``copies``."""

    def cuda_time(fn, copies):
        calls = itertools.cycle(copies)
        return graph_time(lambda: fn(next(calls)), repeats=max(20, len(copies)))

    def cpu_time(fn, copies):
        start = time.perf_counter()
        fn(copies[0])
        return time.perf_counter() - start

    return cpu_time if tiny else cuda_time


def check(qtype, packed, planar, reference, rows, device, generator) -> float:
    """Raise unless the kernels agree with the torch reference; returns the matmul's relative error."""
    n, k = reference.shape
    dtype = torch.float32 if device == "cpu" else torch.bfloat16  # the interpreter computes bf16 wrongly
    values = gguf_dequantize(planar, qtype, n, k, dtype, planar=True)
    if not torch.equal(values, reference.to(dtype)):
        raise AssertionError(f"{qtype.name} [{n}, {k}]: the dequantize kernel differs from the torch reference")
    x = torch.randn(rows, k, device=device, generator=generator).to(dtype)
    # the integer GEMV multiplies x rounded to int8 per 32 values (fw_gguf.kernels.gemv)
    rounded = uses_gemv(qtype, n, k, rows) or uses_mmq(qtype, n, k, rows)
    x_used = quantize_x_reference(x.float()) if rounded else x
    expected = x_used.double() @ reference.double().T
    error = (
        (gguf_matmul(x, planar, qtype, n, k, planar=True).double() - expected).abs().max() / expected.abs().max()
    ).item()
    if error > (1e-5 if dtype == torch.float32 else 2e-2):
        raise AssertionError(f"{qtype.name} [{n}, {k}] x {rows} rows: matmul relative error {error:.3g}")
    return error


def measure(qtype, n, k, rows, sweep, tiny, device, generator, deadline=float("inf")) -> dict:
    packed = random_blocks(qtype, n, k, device, generator)
    planar = to_planar(packed, qtype)
    reference = dequantize(packed, qtype, (n, k))
    # checked at up to 64 rows (fp64 reference matmuls of 512 rows of the LM head take seconds)
    error = check(qtype, packed, planar, reference, min(rows, 8 if tiny else 64), device, generator)
    dtype = torch.float32 if tiny else torch.bfloat16
    dense = reference.to(dtype)
    del reference, packed
    x = torch.randn(rows, k, device=device, generator=generator).to(dtype)
    copies = [planar] + [planar.clone() for _ in range(0 if tiny else -(-COLD_BYTES // planar.nbytes) - 1)]
    dense_copies = [dense] + [dense.clone() for _ in range(0 if tiny else -(-COLD_BYTES // dense.nbytes) - 1)]
    time_it = timer(tiny)
    gemv = uses_gemv(qtype, n, k, rows)
    elementwise = kernel_config(qtype, n, k, rows, torch.device(device))
    rule = (
        gemv_setting(
            qtype,
            n,
            k,
            "cpu" if tiny else torch.cuda.get_device_name(0),
            132 if tiny else torch.cuda.get_device_properties(0).multi_processor_count,
        )
        if gemv
        else elementwise
    )
    kernel_s = time_it(lambda w: gguf_matmul(x, w, qtype, n, k, planar=True, config=rule), copies)
    elementwise_s = (
        time_it(lambda w: gguf_matmul(x, w, qtype, n, k, planar=True, config=elementwise), copies) if gemv else kernel_s
    )
    mmq = mmq_setting(qtype, n, k, rows, torch.device(device)) if rows > 1 and mmq_supported(qtype, k, 0) else None
    mmq_s = time_it(lambda w: gguf_matmul(x, w, qtype, n, k, planar=True, config=mmq), copies) if mmq else None
    scratch = torch.empty(n, k, dtype=dtype, device=device)

    def dequantize_then_cublas(w):
        return torch.nn.functional.linear(x, gguf_dequantize(w, qtype, n, k, dtype, planar=True, out=scratch))

    dequant_s = time_it(dequantize_then_cublas, copies)
    cublas_s = time_it(lambda w: torch.nn.functional.linear(x, w), dense_copies)
    packed_bytes = planar.numel()
    result = {
        "type": qtype.name,
        "n": n,
        "k": k,
        "rows": rows,
        "packed_bytes": packed_bytes,
        "check_rel_error": error,
        "rule": {"kind": type(rule).__name__, **rule.__dict__},
        "rule_us": kernel_s * 1e6,
        "elementwise_us": elementwise_s * 1e6,
        "mmq": mmq.__dict__ if mmq else None,
        "mmq_us": mmq_s * 1e6 if mmq else None,
        "default_path": "gemv" if gemv else "mmq" if uses_mmq(qtype, n, k, rows) else "tile",
        "rule_gb_s": packed_bytes / kernel_s / 1e9,
        "rule_copy_fraction": packed_bytes / kernel_s / COPY_BANDWIDTH,
        "dequant_cublas_us": dequant_s * 1e6,
        "cublas_bf16_us": cublas_s * 1e6,
        "cublas_bf16_tb_s": dense.nbytes / cublas_s / 1e12,
        "method_path": "dequantize+cublas" if rows >= DEQUANTIZE_MIN_ROWS else "kernel",
    }
    if sweep:
        expected = gguf_matmul(x, planar, qtype, n, k, planar=True, config=mmq or rule).float()
        settings, refused = [], []
        grid = gemv_sweep_settings() if gemv else mmq_sweep_settings(rows) if mmq else sweep_settings(qtype, rows)
        for config in grid:
            if time.perf_counter() > deadline:
                refused.append({**config.__dict__, "error": "not timed: past --time-limit"})
                continue
            try:  # a setting may need more shared memory than an SM has: report it, time the rest
                error = (gguf_matmul(x, planar, qtype, n, k, planar=True, config=config).float() - expected).abs().max()
            except Exception as exc:  # noqa: BLE001 (Triton's OutOfResources and compile errors alike)
                refused.append({**config.__dict__, "error": f"{type(exc).__name__}: {exc}"[:200]})
                continue
            if error > 0.05 * expected.abs().max():  # a wrong setting must not win
                refused.append({**config.__dict__, "error": f"wrong result, error {error.item():.3g}"})
                print(f"  WRONG: {qtype.name} {rows}x{k} @ {n}x{k} at {config}: error {error.item():.3g}")
                continue
            seconds = time_it(
                lambda w, config=config: gguf_matmul(x, w, qtype, n, k, planar=True, config=config), copies
            )
            settings.append({"kind": type(config).__name__, **config.__dict__, "us": seconds * 1e6})
        result.update(settings=settings, refused=refused)
        if settings:
            best = min(settings, key=lambda s: s["us"])
            result.update(best=best, best_gb_s=packed_bytes / (best["us"] / 1e6) / 1e9)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=TYPES, choices=sorted(t.name for t in GROUPS))
    parser.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 512])
    parser.add_argument("--sweep", action="store_true", help="also time a grid of settings per case")
    parser.add_argument("--tiny", action="store_true", help="small shapes on the CPU under the interpreter")
    parser.add_argument("--moe", action="store_true", help="the MoE kernel at the Qwen3-30B-A3B Q4_K_M shape instead")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512], help="--moe: token counts")
    parser.add_argument("--time-limit", type=float, default=85.0, help="seconds: start no case or setting past it")
    parser.add_argument("--out")
    args = parser.parse_args()
    deadline = time.perf_counter() + args.time_limit
    if args.moe:
        from gguf_moe_kernels import run_moe

        return run_moe(args)
    tiny = args.tiny or not torch.cuda.is_available()
    device = "cpu" if tiny else "cuda"
    layers = TINY_LAYERS if tiny else {name: LAYERS[name] for name in args.layers}
    rows_list = [1, 3, 17] if tiny else args.rows
    generator = torch.Generator(device).manual_seed(0)
    results = []
    print(
        f"{'type':6s} {'layer':8s} {'N':>6s} {'K':>6s} {'rows':>4s} {'kernel us':>10s} {'GB/s':>7s} {'copy%':>6s} "
        f"{'elementwise us':>14s} {'mmq us':>8s} {'deq+cuBLAS us':>13s} {'bf16 cuBLAS us':>14s} {'best us':>8s}",
        flush=True,
    )
    skipped = []
    for type_name, (name, (n, k)), rows in itertools.product(args.types, layers.items(), rows_list):
        if time.perf_counter() > deadline:
            skipped.append(f"{type_name} {name} {rows}")
            continue
        qtype = GGMLQuantizationType[type_name]
        result = {"layer": name, **measure(qtype, n, k, rows, args.sweep, tiny, device, generator, deadline)}
        results.append(result)
        best = f"{result['best']['us']:8.1f}" if "best" in result else "-"
        mmq_us = f"{result['mmq_us']:8.1f}" if result["mmq_us"] is not None else "-"
        print(
            f"{type_name:6s} {name:8s} {n:6d} {k:6d} {rows:4d} {result['rule_us']:10.1f} {result['rule_gb_s']:7.0f} "
            f"{100 * result['rule_copy_fraction']:5.1f}% {result['elementwise_us']:14.1f} {mmq_us:>8s} "
            f"{result['dequant_cublas_us']:13.1f} {result['cublas_bf16_us']:14.1f} {best:>8s}",
            flush=True,
        )
        if not tiny:
            torch.cuda.empty_cache()
    if args.sweep:
        print("# fw_gguf.kernels.matmul.TUNED entries (the sweep's fastest per case):")
        name = "cpu" if tiny else torch.cuda.get_device_name(0)
        for r in results:
            if "best" not in r:
                continue
            best = {key: value for key, value in r["best"].items() if key not in ("us", "kind")}
            if r["best"]["kind"] == "MmqConfig":
                print(
                    f"    ({name!r}, {r['type']!r}, {r['n']}, {r['k']}, {row_bucket(r['rows'])}): MmqConfig(**{best}),  # MMQ_TUNED"
                )
            elif r["best"]["kind"] == "GemvConfig":
                print(f"    ({name!r}, {r['type']!r}, {r['n']}, {r['k']}): GemvConfig(**{best}),  # GEMV_TUNED")
            else:
                print(
                    f"    ({name!r}, {r['type']!r}, {r['n']}, {r['k']}, {row_bucket(r['rows'])}): GGUFKernelConfig(**{best}),"
                )
    if skipped:
        print(f"# past --time-limit {args.time_limit:.0f} s, not measured: {', '.join(skipped)}", flush=True)
    if args.out:
        write_kernel_report(
            args.out, results, copy_bandwidth=COPY_BANDWIDTH, tiny=tiny, dequantize_min_rows=DEQUANTIZE_MIN_ROWS
        )


if __name__ == "__main__":
    main()
