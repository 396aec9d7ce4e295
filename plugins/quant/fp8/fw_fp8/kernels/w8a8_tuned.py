"""W8A8 block GEMM settings measured on a GPU model for the GEMV rows (1-16, the decode batch sizes).

``TUNED_W8A8[device name][(N, K)]`` is the fastest setting of ``benchmarks/fp8_kernels.py --rows 1
--sweep`` for ``[rows, K] @ [N, K]^T`` with block FP8 weights (keys of
:func:`fw_fp8.kernels.w8a8_block.choose_config`: ``BLOCK_M``, ``BLOCK_N``, ``SPLIT_K``,
``num_warps``, ``num_stages``), timed with the weights read from HBM in CUDA graphs. The sweep prints
these lines, ready to paste, at its end. Shapes and GPUs not listed take ``choose_config``'s rule.
As for the bf16 GEMV (:mod:`fw_triton_ops.gemv_tuned`), a table rather than ``triton.autotune``:
nothing is timed at run time, so no call synchronises or breaks a CUDA-graph capture, and every run
and rank of one GPU model launches the same setting.
"""

from __future__ import annotations

#: Empty until the sweep has run on the GPU: every shape takes the rule.
TUNED_W8A8: dict[str, dict[tuple[int, int], dict[str, int]]] = {}
