"""Entry point of the ``triton_attention`` plugin: registration only, no torch or triton import here."""

from framework import hookimpl
from framework.specs import AttentionBackendSpec


@hookimpl
def register_attention_backends():
    return [
        AttentionBackendSpec(
            name="triton",
            impl="fw_triton_attention.backend:TritonAttentionBackend",
            description="paged attention in Triton: prefill over cached prefixes, split-KV decode; GQA, "
            "sliding window, soft-cap; multi-head latent attention over the 'mla' latent cache",
            priority=50,
            devices=("cuda",),
            requires=("triton",),
            min_compute_capability=(8, 0),  # bf16 tensor-core dots
            kv_cache_layouts=("standard", "mla"),
            kv_cache_dtypes=("auto", "fp8", "turbo8", "turbo4", "turbo3"),
        )
    ]
