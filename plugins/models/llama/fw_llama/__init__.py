"""fw plugin: the Llama family of decoder-only transformers, and its mixture-of-experts members."""
