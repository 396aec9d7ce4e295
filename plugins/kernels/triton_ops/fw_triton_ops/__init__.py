"""fw plugin: Triton kernels for rms_norm, fused_add_rms_norm, silu_and_mul, gelu_tanh_and_mul, rotary_embedding,
qk_norm_rotary_embedding, fused_moe."""
