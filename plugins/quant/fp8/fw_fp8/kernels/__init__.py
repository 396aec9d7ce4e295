"""FP8 kernels: the W8A16 Triton core, the block-scaled W8A8 Triton GEMM, ``torch._scaled_mm``, and the dispatch."""
