"""The FP4 dense kernels (``fw_fp4.kernels.fp4_linear``) for ``w4a16_kernels.py --variants nvfp4 mxfp4``.

    python benchmarks/w4a16_kernels.py --variants nvfp4                 # Llama-3-8B shapes, rows 1..512
    python benchmarks/w4a16_kernels.py --variants nvfp4 mxfp4 --rows 1      # the one-row integer GEMV (< 60 s)
    python benchmarks/w4a16_kernels.py --variants nvfp4 --rows 1 --sweep    # its 18 settings per layer (< 90 s)
    python benchmarks/w4a16_kernels.py --variants nvfp4 --sweep --layers down --rows 16
    python benchmarks/w4a16_kernels.py --variants nvfp4 mxfp4 --tiny    # the script itself on a CPU

Each case checks the kernel against ``x @ W^T`` on the dequantized weight (one row on CUDA: the
integer GEMV, against x rounded to int8 per 32 inputs as it rounds it; its float GEMV is timed
beside it as ``exact_gemv_us``), then times it (and bf16 cuBLAS on the dense matrix) replayed from a CUDA graph over weight copies that overflow the L2,
with the result keys of ``w4a16_kernels.py``. Weights are random codes with scales of about 1e-2.
"""

from __future__ import annotations

import torch
from common import copies_timer, time_kernel_settings
from fw_fp4.kernels.fp4_gemv import int8_gemv_config, int8_gemv_supported
from fw_fp4.kernels.fp4_linear import DEFAULT_NUM_SMS, choose_config, fp4_matmul, int8_gemv_default
from fw_fp4.kernels.int8_dot import quantize_x_reference
from fw_fp4.kernels.layout import GROUP_SIZES, Fp4KernelWeight, dequantize_kernel_weight, to_kernel_layout

VARIANTS = tuple(GROUP_SIZES)
COLD_BYTES = 512 * 2**20  # weight copies each timing cycles through: several times the H200's L2


def random_fp4_weight(fmt: str, n: int, k: int, device: str) -> Fp4KernelWeight:
    """Random codes; NVFP4: e4m3 scales in 64..128 and a global 1e-4; MXFP4: scales 2^-9 .. 2^-7."""
    generator = torch.Generator(device).manual_seed(n + k)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device, generator=generator)
    groups = k // GROUP_SIZES[fmt]
    if fmt == "nvfp4":
        scales = (64 + 64 * torch.rand(n, groups, device=device, generator=generator)).to(torch.float8_e4m3fn)
        return to_kernel_layout(packed, scales, torch.full((n,), 1e-4, device=device), fmt)
    scales = torch.randint(118 + 14, 121 + 14, (n, groups), dtype=torch.uint8, device=device, generator=generator)
    return to_kernel_layout(packed, scales, None, fmt)  # already rebased (+14)


def num_sms(device: str) -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else DEFAULT_NUM_SMS


def sweep_settings(rows: int) -> list[dict]:
    """The grid ``--sweep`` times: for one row the integer GEMV's (outputs a program = 128 per warp,
    K step, split-K: 18 settings); else ``w4a16_kernels.py``'s tl.dot settings, and for rows up to
    ``GEMV_MAX_ROWS`` the tensor-core-free GEMV's (output block, K step, split-K, warps)."""
    import itertools

    from fw_fp4.kernels.fp4_linear import GEMV_MAX_ROWS
    from w4a16_kernels import sweep_settings as dot_settings

    if rows == 1:
        return [
            {"KIND": "int8", "BLOCK_N": 128 * warps, "STEP": step, "SPLIT_K": split_k, "num_warps": warps}
            for warps, step, split_k in itertools.product((1, 2, 4), (64, 128, 256), (1, 8))
        ]
    grid = [{"KIND": "dot", **setting} for setting in dot_settings(rows)]
    if rows <= 2 * GEMV_MAX_ROWS:
        for block_n, block_k, split_k, warps in itertools.product(
            (64, 128, 256), (256, 512, 1024), (1, 2, 4, 8), (4, 8)
        ):
            grid.append(
                {
                    "KIND": "gemv",
                    "BLOCK_N": block_n,
                    "BLOCK_K": block_k,
                    "SPLIT_K": split_k,
                    "num_warps": warps,
                    "num_stages": 3,
                }
            )
    return grid


def measure_fp4(variant: str, n: int, k: int, rows: int, sweep: bool, tiny: bool) -> dict:

    device, dtype = ("cpu", torch.float32) if tiny else ("cuda", torch.bfloat16)
    weight = random_fp4_weight(variant, n, k, device)
    dense = dequantize_kernel_weight(weight, dtype)
    x = torch.randn(rows, k, device=device, dtype=dtype)
    exact = x.double() @ dense.double().t()
    # one row on CUDA: the integer GEMV, which multiplies x rounded to int8 per 32 inputs
    int8 = rows == 1 and int8_gemv_default(x) and int8_gemv_supported(weight)
    expected = quantize_x_reference(x).double() @ dense.double().t() if int8 else exact
    error = ((fp4_matmul(x, weight).double() - expected).abs().max() / expected.abs().max()).item()
    if error > (1e-4 if tiny else 2e-2):
        raise AssertionError(f"{variant} {rows}x{k} @ [{n}, {k}]: relative error {error:.3g}")
    packed_bytes = sum(t.nbytes for t in (weight.codes, weight.scales, weight.row_scales) if t is not None)
    extra = 0 if tiny else -(-COLD_BYTES // packed_bytes) - 1
    copies = [weight] + [weight._replace(codes=weight.codes.clone()) for _ in range(extra)]
    dense_copies = [dense] + [dense.clone() for _ in range(0 if tiny else -(-COLD_BYTES // dense.nbytes) - 1)]
    time_it = copies_timer(tiny)
    kernel_s = time_it(lambda w: fp4_matmul(x, w), copies)
    cublas_s = time_it(lambda w: torch.nn.functional.linear(x, w), dense_copies)
    result = {
        "variant": variant,
        "n": n,
        "k": k,
        "rows": rows,
        "packed_bytes": packed_bytes,
        "check_rel_error": error,
        "rule": int8_gemv_config(n, k, num_sms(device)) if int8 else choose_config(rows, n, k),
        "kernel_us": kernel_s * 1e6,
        "kernel_gb_s": packed_bytes / kernel_s / 1e9,
        "cublas_bf16_us": cublas_s * 1e6,
        "speedup_vs_bf16": cublas_s / kernel_s,
    }
    if int8:  # the float GEMV it replaces, exact in x
        gemv = {**choose_config(1, n, k, num_sms(device)), "KIND": "gemv"}
        result["exact_gemv_us"] = time_it(lambda w: fp4_matmul(x, w, config=gemv), copies) * 1e6
    if sweep:
        run = lambda w, config: fp4_matmul(x, w, config=config)  # noqa: E731
        result.update(time_kernel_settings(run, sweep_settings(rows), expected, copies, time_it, packed_bytes))
    return result
