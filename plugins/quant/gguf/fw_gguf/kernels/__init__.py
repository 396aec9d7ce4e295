"""Triton kernels over packed GGUF weights: decoding per type (:mod:`.decode`), the GEMV /
tensor-core matmul and the dequantize kernel (:mod:`.matmul`)."""
