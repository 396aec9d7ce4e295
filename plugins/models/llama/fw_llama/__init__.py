"""fw plugin: the Llama family of decoder-only transformers."""
