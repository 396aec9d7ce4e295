"""fw plugin: the FlashInfer attention backend."""
