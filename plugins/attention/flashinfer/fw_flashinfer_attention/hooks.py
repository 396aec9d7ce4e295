"""Entry point of the ``flashinfer_attention`` plugin: registration only, no torch or flashinfer import here."""

from framework import hookimpl
from framework.specs import AttentionBackendSpec


@hookimpl
def register_attention_backends():
    return [
        AttentionBackendSpec(
            name="flashinfer",
            impl="fw_flashinfer_attention.backend:FlashInferAttentionBackend",
            description="FlashInfer batch prefill (cached prefix) and decode wrappers, planned once per step, "
            "decode run inside CUDA graphs; GQA, sliding window, soft-cap",
            priority=40,
            devices=("cuda",),
            requires=("flashinfer",),
            min_compute_capability=(8, 0),
            kv_cache_layouts=("standard",),
            kv_cache_dtypes=("auto",),
            model_dtypes=("float16", "bfloat16"),
        )
    ]
