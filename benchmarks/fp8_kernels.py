"""The FP8 kernels (``fw_fp8.kernels``) against bf16 cuBLAS, Llama-3-8B shapes, block FP8 weights.

    python benchmarks/fp8_kernels.py                        # table; JSON to $OUT/fp8_kernels.json if $OUT is set
    python benchmarks/fp8_kernels.py --layers down --rows 1 8 64 --out fp8.json
    python benchmarks/fp8_kernels.py --tiny [--sweep]       # the script itself on a CPU (TRITON_INTERPRET=1)
    python benchmarks/fp8_kernels.py --rows 1 --sweep       # + W8A8 block settings per case, the table to paste
    python benchmarks/fp8_kernels.py --rows 1 --sweep w8a16 # + a grid of W8A16 settings instead (slow)
    python benchmarks/fp8_kernels.py --moe [--tokens 1 8 64 512] [--sweep]   # the MoE kernel: quant_moe_kernels.py

For each layer (fused qkv, o, fused gate_up, down, LM head) and row count it checks every path
against ``x @ W^T`` on the dequantized weight, then times, replayed from a CUDA graph over weight
copies that overflow the L2: the W8A16 kernel (block scales), the block-scaled W8A8 GEMM (1x128
activation groups, sm_89+, its setting from ``choose_config``: the tuned table or the rule),
``torch._scaled_mm`` on a per-channel copy of the weight (sm_89+), and bf16 cuBLAS.
``fw_fp8.kernels.dispatch`` picks among them from these timings.

``--sweep`` (``w8a8``, the default) times a few W8A8 block settings per case: for the decode rows
(up to 16) tiles of 16 rows x 32 / 64 / 128 outputs, 4 stages (and 3 for 64 outputs), and the splits of K that put
between one and 16 programs on each SM (at least two 128-input groups a split); more rows 32 / 64 x
64 / 128 tiles and up to four splits. Split-K is a launch argument, not a compile-time constant, so
the whole ``--rows 1`` sweep compiles about ten variants (under 60 s on the H200). Each line is
printed as it is timed (one more: the rule's setting with the activation quantizer as a separate
launch, what the fused quantization saves); at the end, the fastest setting of each decode case as lines of
``fw_fp8/kernels/w8a8_tuned.py``'s table (with the rule's time beside it).
"""

from __future__ import annotations

import argparse
import itertools
import os

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from common import copies_timer, write_kernel_report  # noqa: E402
from fw_fp8.kernels.dispatch import SMALL_MAX_ROWS, choose_paths, has_fp8_tensor_cores  # noqa: E402
from fw_fp8.kernels.layout import Fp8Weight, dequantize_fp8_weight  # noqa: E402
from fw_fp8.kernels.w8a8_block import GEMV_MAX_ROWS, GROUP, split_groups, w8a8_block_matmul  # noqa: E402
from fw_fp8.kernels.w8a8_block import choose_config as w8a8_config  # noqa: E402
from fw_fp8.kernels.w8a8_tuned import row_bucket  # noqa: E402
from fw_fp8.kernels.w8a16 import choose_config, w8a16_matmul  # noqa: E402
from fw_fp8.quantize import FP8_DTYPE, FP8_MAX, quantize_weight_fp8  # noqa: E402

LAYERS = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "head": (128256, 4096),
}
TINY_LAYERS = {"qkv": (96, 256), "down": (64, 512)}
ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
COLD_BYTES = 512 * 2**20


def sweep_settings(rows: int, tiny: bool) -> list[dict]:
    """The W8A16 grid ``--sweep w8a16`` times: 16-row tiles with long K steps for the GEMV rows, bigger tiles above."""
    if tiny:
        return [{"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "SPLIT_K": 2, "num_warps": 4, "num_stages": 2}]
    if rows <= 16:
        grid = itertools.product([16], [32, 64, 128], [256, 512, 1024], [1, 2, 4], [4], [3, 4])
    else:
        grid = itertools.product([32, 64] if rows <= 64 else [64, 128], [64, 128], [128, 256], [1, 2, 4], [4], [3])
    return [
        {"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": s, "num_warps": w, "num_stages": st}
        for m, n, k, s, w, st in grid
        if n * k <= 65536  # one stage of weight bytes within 64 KB
    ]


def w8a8_sweep_settings(rows: int, n: int, k: int, num_sms: int, tiny: bool) -> list[dict]:
    """The W8A8 block settings ``--sweep`` times (the module docstring says which), without repeats:
    two splits that launch the same grid are one setting."""
    fused = rows <= GEMV_MAX_ROWS  # the decode rows quantize x inside the GEMM
    if tiny:
        return [
            {"BLOCK_M": 16, "BLOCK_N": 32, "SPLIT_K": s, "FUSED_QUANT": False, "num_warps": 4, "num_stages": 2}
            for s in (1, 2)
        ]
    if rows <= GEMV_MAX_ROWS:
        tiles, splits, most = [(16, 32, 4), (16, 64, 3), (16, 64, 4), (16, 128, 4)], (1, 2, 4, 8, 16), 16
    else:
        tiles, splits, most = [(32, 64, 3), (64, 64, 3), (64, 128, 3)], (1, 2, 4), 8
    groups, settings, grids = -(-k // GROUP), [], set()
    for (block_m, block_n, num_stages), split_k in itertools.product(tiles, splits):
        per_split, launched = split_groups(groups, split_k)
        programs = -(-n // block_n) * -(-rows // block_m) * launched
        if launched > 1 and (per_split < 2 or programs < num_sms or programs > most * num_sms):
            continue
        if (block_m, block_n, launched, num_stages) in grids:
            continue
        grids.add((block_m, block_n, launched, num_stages))
        settings.append(
            {
                "BLOCK_M": block_m,
                "BLOCK_N": block_n,
                "SPLIT_K": launched,
                "FUSED_QUANT": fused,
                "num_warps": 4,
                "num_stages": num_stages,
            }
        )
    if fused:  # the rule's setting with the quantizer launched before the GEMM: what fusing saves
        settings.append({**w8a8_config(rows, n, k, num_sms), "FUSED_QUANT": False})
    return settings


def measure(n: int, k: int, rows: int, tiny: bool, sweep: str | None = None, label: str = "") -> dict:
    """One case: every path checked and timed; ``sweep`` (``w8a8`` / ``w8a16``) adds that kernel's settings,
    each printed (prefixed by ``label``) as it is timed."""
    device, dtype = ("cpu", torch.float32) if tiny else ("cuda", torch.bfloat16)
    generator = torch.Generator(device).manual_seed(n + k)
    q, scale = quantize_weight_fp8(torch.randn(n, k, device=device, generator=generator) * 0.02)
    weight = Fp8Weight(q, scale, 128, 128)
    dense = dequantize_fp8_weight(weight, dtype)
    x = torch.randn(rows, k, device=device, dtype=dtype)
    expected = x.double() @ dense.double().t()
    paths = {"w8a16": lambda w: w8a16_matmul(x, w)}
    fp8_cores = not tiny and has_fp8_tensor_cores(x.device)
    # the interpreter mis-rounds float -> FP8 (0.49 -> 0.25): on the CPU the torch quantizer, not the fused one
    unfused = {**w8a8_config(rows, n, k), "FUSED_QUANT": False} if tiny else None
    if fp8_cores or tiny:
        paths["w8a8_block"] = lambda w: w8a8_block_matmul(x, w, config=unfused)
    channel = None
    if fp8_cores:  # the per-channel layout _scaled_mm takes
        row_scale = dense.float().abs().amax(1, keepdim=True) / FP8_MAX
        channel = Fp8Weight((dense.float() / row_scale).to(FP8_DTYPE), row_scale, 1, k)
        from fw_fp8.kernels.scaled_mm import scaled_mm_linear

        paths["scaled_mm"] = lambda w: scaled_mm_linear(x, w)
    num_sms = 132 if tiny else torch.cuda.get_device_properties(x.device).multi_processor_count
    device_name = "cpu" if tiny else torch.cuda.get_device_name(x.device)
    time_it = copies_timer(tiny)
    result = {
        "n": n,
        "k": k,
        "rows": rows,
        "rule": choose_config(rows, n, k, 128),
        "w8a8_setting": w8a8_config(rows, n, k, num_sms, device_name),
        "dispatch": choose_paths(x.device, "block", dtype, n, k).choose(rows) if not tiny else "w8a8_block",
    }
    weight_bytes = q.nbytes + scale.nbytes
    copies = [weight] + [
        weight._replace(qweight=weight.qweight.clone())
        for _ in range(0 if tiny else -(-COLD_BYTES // weight_bytes) - 1)
    ]
    for name, run in paths.items():
        base = copies
        if name == "scaled_mm":  # as many copies of the per-channel weight (its bytes are the same)
            base = [channel] + [channel._replace(qweight=channel.qweight.clone()) for _ in copies[1:]]
        error = ((run(base[0]).double() - expected).abs().max() / expected.abs().max()).item()
        if error > (1e-4 if tiny and name == "w8a16" else 6e-2):
            raise AssertionError(f"{name} {rows}x{k} @ [{n}, {k}]: relative error {error:.3g}")
        seconds = time_it(run, base)
        result[name] = {"us": seconds * 1e6, "gb_s": weight_bytes / seconds / 1e9, "check_rel_error": error}
        del base
    if sweep:
        kernel = w8a16_matmul if sweep == "w8a16" else w8a8_block_matmul
        settings = sweep_settings(rows, tiny) if sweep == "w8a16" else w8a8_sweep_settings(rows, n, k, num_sms, tiny)
        timed, refused = [], []
        for setting in settings:
            try:  # a setting may need more shared memory than an SM has: report it, time the rest
                out = kernel(x, weight, config=setting)
            except Exception as exc:  # noqa: BLE001 (Triton's OutOfResources and compile errors alike)
                refused.append({**setting, "error": f"{type(exc).__name__}: {exc}"[:200]})
                print(f"{label} refused {setting}: {refused[-1]['error']}", flush=True)
                continue
            error = ((out.double() - expected).abs().max() / expected.abs().max()).item()
            if error > (1e-4 if tiny and sweep == "w8a16" else 6e-2):
                raise AssertionError(f"{sweep} {setting}: relative error {error:.3g}")
            us = time_it(lambda w, c=setting: kernel(x, w, config=c), copies) * 1e6
            timed.append({**setting, "us": us})
            print(f"{label} {sweep} {us:8.1f} us {weight_bytes / us / 1e6:6.2f} TB/s  {setting}", flush=True)
        result[f"{sweep}_sweep"] = sorted(timed, key=lambda t: t["us"])
        result[f"{sweep}_refused"] = refused
    del copies
    dense_copies = [dense] + [dense.clone() for _ in range(0 if tiny else -(-COLD_BYTES // dense.nbytes) - 1)]
    result["cublas_bf16_us"] = time_it(lambda w: torch.nn.functional.linear(x, w), dense_copies) * 1e6
    return result


def tuned_lines(results: list[dict]) -> list[str]:
    """The fastest W8A8 setting of each swept row bucket and shape as lines of ``w8a8_tuned.TUNED_W8A8``
    (a bucket's line from the fewest rows swept in it), with its time, the dispatched setting's and
    bf16 cuBLAS's."""
    lines, seen = [], set()
    for result in sorted(results, key=lambda r: r["rows"]):
        key = (row_bucket(result["rows"]), result["n"], result["k"])
        if not result.get("w8a8_sweep") or key[0] is None or key in seen:
            continue
        seen.add(key)
        best = {name: value for name, value in result["w8a8_sweep"][0].items() if name != "us"}
        lines.append(
            f"        {key}: {best},  # {result['w8a8_sweep'][0]['us']:.1f} us, dispatched "
            f"{result['w8a8_block']['us']:.1f}, bf16 cuBLAS {result['cublas_bf16_us']:.1f}: "
            f"{result['layer']} at {result['rows']} rows"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    parser.add_argument("--rows", nargs="+", type=int, default=ROWS)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (checks the script)")
    parser.add_argument(
        "--sweep",
        nargs="?",
        const="w8a8",
        choices=["w8a8", "w8a16"],
        help="also time settings of the W8A8 block GEMM (default) or the W8A16 kernel per case",
    )
    parser.add_argument("--moe", action="store_true", help="the MoE kernel at the Qwen3-30B-A3B shape instead")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512], help="--moe: token counts")
    parser.add_argument("--out", help="the JSON report (default: $OUT/fp8_kernels.json or fp8_moe.json)")
    args = parser.parse_args()
    if args.out is None and os.environ.get("OUT"):
        args.out = os.path.join(os.environ["OUT"], "fp8_moe.json" if args.moe else "fp8_kernels.json")
    if args.moe:
        from quant_moe_kernels import run_moe

        args.sweep = bool(args.sweep)
        return run_moe(args, "fp8")
    tiny = args.tiny or not torch.cuda.is_available()
    layers = TINY_LAYERS if tiny else {name: LAYERS[name] for name in args.layers}
    results = []
    header = f"{'layer':8} {'rows':>5} {'w8a16 us':>9} {'w8a8 us':>9} {'scaled_mm':>9} {'bf16 us':>9} {'swept us':>9}"
    print(header, flush=True)
    for (name, (n, k)), rows in itertools.product(layers.items(), [1, 3, 17] if tiny else args.rows):
        result = {"layer": name, **measure(n, k, rows, tiny, args.sweep, label=f"{name:8} {rows:5d}")}
        results.append(result)
        cells = [
            f"{result[p]['us']:9.1f}" if p in result else f"{'-':>9}" for p in ("w8a16", "w8a8_block", "scaled_mm")
        ]
        best = result.get(f"{args.sweep}_sweep", [{}])[0]
        swept = f"{best['us']:9.1f} {best}" if best else ""
        print(f"{name:8} {rows:5d} {' '.join(cells)} {result['cublas_bf16_us']:9.1f} {swept}", flush=True)
    if args.sweep == "w8a8":
        print("fastest W8A8 settings, for fw_fp8/kernels/w8a8_tuned.py's TUNED_W8A8[device name]:", flush=True)
        print("\n".join(tuned_lines(results)), flush=True)
    if args.out:
        write_kernel_report(args.out, results, tiny=tiny, small_max_rows=SMALL_MAX_ROWS, sweep=args.sweep)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
