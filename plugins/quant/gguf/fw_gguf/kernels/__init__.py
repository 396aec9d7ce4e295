"""Triton kernels over packed GGUF weights: the block fields and planar layout (:mod:`.layout`,
plain torch), per-type decoding (:mod:`.decode`), and the GEMV / tensor-core matmul and the
dequantize kernel (:mod:`.matmul`)."""
