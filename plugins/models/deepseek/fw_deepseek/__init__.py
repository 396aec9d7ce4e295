"""fw plugin: DeepSeek-V2 / V2-Lite (multi-head latent attention with a compressed KV cache, DeepSeek MoE)."""
