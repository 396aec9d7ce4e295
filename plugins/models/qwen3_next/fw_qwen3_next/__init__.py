"""fw plugin: Qwen3-Next and Qwen3.5 (dense and MoE), hybrid Gated DeltaNet / gated attention decoders."""
