"""W8A8 block GEMM settings measured on a GPU model, per row bucket and layer shape.

``TUNED_W8A8[device name][(bucket, N, K)]`` is the fastest setting that ``benchmarks/fp8_kernels.py
--sweep`` timed for ``[rows, K] @ [N, K]^T`` with block FP8 weights (keys of
:func:`fw_fp8.kernels.w8a8_block.choose_config`), the weights read from HBM in CUDA graphs. It serves
the rows of its bucket (:data:`ROW_BUCKETS`: up to 16 rows, the 16-row GEMV tiles; up to 32; up to 64);
the sweep measures a bucket at the fewest rows swept in it (batch 1 for the GEMV bucket) and prints
these lines, ready to paste, at its end. Shapes, buckets and GPUs not listed take the rule.
As for the bf16 GEMV (:mod:`fw_triton_ops.gemv_tuned`), a table rather than ``triton.autotune``:
nothing is timed at run time, so no call synchronises or breaks a CUDA-graph capture, and every run
and rank of one GPU model launches the same setting.
"""

from __future__ import annotations

#: The row buckets a tuned setting serves: rows up to 16, 17-32, 33-64 (more rows take the rule).
ROW_BUCKETS = (16, 32, 64)


def row_bucket(rows: int) -> int | None:
    """The bucket serving ``rows``, or None above the last."""
    return next((bucket for bucket in ROW_BUCKETS if rows <= bucket), None)


TUNED_W8A8: dict[str, dict[tuple[int, int, int], dict[str, int]]] = {
    # benchmarks/fp8_kernels.py --rows 1 --sweep on main at c3e61b8 (times at 1 row; "dispatched": the
    # rule of that commit, which quantized inside the GEMM on every decode row)
    "NVIDIA H200": {
        (16, 6144, 4096): {
            "BLOCK_M": 16,
            "BLOCK_N": 64,
            "SPLIT_K": 4,
            "FUSED_QUANT": False,
            "num_warps": 4,
            "num_stages": 4,
        },  # 12.3 us, dispatched 14.6, bf16 cuBLAS 15.4: qkv
        (16, 4096, 4096): {
            "BLOCK_M": 16,
            "BLOCK_N": 128,
            "SPLIT_K": 8,
            "FUSED_QUANT": True,
            "num_warps": 4,
            "num_stages": 4,
        },  # 11.1 us, dispatched 12.4, bf16 cuBLAS 13.2: o
        (16, 28672, 4096): {
            "BLOCK_M": 16,
            "BLOCK_N": 64,
            "SPLIT_K": 1,
            "FUSED_QUANT": False,
            "num_warps": 4,
            "num_stages": 4,
        },  # 33.4 us, dispatched 48.7, bf16 cuBLAS 57.4: gate_up
        (16, 4096, 14336): {
            "BLOCK_M": 16,
            "BLOCK_N": 64,
            "SPLIT_K": 8,
            "FUSED_QUANT": False,
            "num_warps": 4,
            "num_stages": 4,
        },  # 21.9 us, dispatched 26.0, bf16 cuBLAS 32.0: down
        (16, 128256, 4096): {
            "BLOCK_M": 16,
            "BLOCK_N": 64,
            "SPLIT_K": 1,
            "FUSED_QUANT": False,
            "num_warps": 4,
            "num_stages": 4,
        },  # 134.8 us, dispatched 174.4, bf16 cuBLAS 246.4: head
    },
}
