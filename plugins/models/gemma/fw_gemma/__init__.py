"""fw plugin: the Gemma family (Gemma, Gemma 2, Gemma 3 text) of decoder-only transformers."""
