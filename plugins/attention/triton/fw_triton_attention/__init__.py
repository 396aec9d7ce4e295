"""fw plugin: paged attention in Triton (KV store, prefill over a cached prefix, split-KV decode)."""
