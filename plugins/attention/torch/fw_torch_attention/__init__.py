"""fw plugin: the reference paged-attention backend in plain torch."""
