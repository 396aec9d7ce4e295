"""Entry point of the ``torch_attention`` plugin: registration only, no torch import here."""

from framework import hookimpl
from framework.specs import AttentionBackendSpec


@hookimpl
def register_attention_backends():
    return [
        AttentionBackendSpec(
            name="torch",
            impl="fw_torch_attention.backend:TorchAttentionBackend",
            description="reference paged attention in plain torch; runs anywhere, slow, exact",
            priority=0,
            kv_cache_layouts=("standard", "mla"),
            kv_cache_dtypes=("auto", "fp8", "turbo8", "turbo4", "turbo3"),
        ),
        AttentionBackendSpec(
            name="torch_sdpa",
            impl="fw_torch_attention.batched:BatchedTorchAttentionBackend",
            description="the reference with decode steps batched into one SDPA call (the CPU's default)",
            priority=10,
            devices=("cpu",),
            kv_cache_layouts=("standard",),
            kv_cache_dtypes=("auto", "fp8", "turbo8", "turbo4", "turbo3"),
        ),
    ]
