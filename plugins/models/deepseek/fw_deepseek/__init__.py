"""fw plugin: DeepSeek-V2 / V2-Lite / V3 / R1 and GLM-4.7-Flash (multi-head latent attention with a compressed KV cache, DeepSeek MoE)."""
