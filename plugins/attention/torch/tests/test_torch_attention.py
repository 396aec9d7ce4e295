"""The reference backend against dense attention on unpaged tensors (many shapes)."""

import pytest
import torch
from fw_torch_attention.backend import TorchAttentionBackend

from framework.testing import check_attention_backend, check_mla_attention_backend


def test_torch_backend_matches_dense_attention_fp32():
    check_attention_backend(TorchAttentionBackend(), atol=1e-5)


def test_torch_backend_matches_dense_attention_bf16():
    check_attention_backend(TorchAttentionBackend(), dtype=torch.bfloat16, atol=2e-2)


@pytest.mark.gpu
def test_torch_backend_matches_dense_attention_on_cuda():
    check_attention_backend(TorchAttentionBackend(), device="cuda", dtype=torch.bfloat16, atol=2e-2)


def test_backend_registration_is_selectable():
    from framework import registries

    spec = registries.attention_backends().get("torch")
    assert spec.load() is TorchAttentionBackend
    assert registries.attention_backends().plugin_of("torch") == "torch_attention"


def test_torch_backend_mla_layout_matches_dense_attention():
    check_mla_attention_backend(TorchAttentionBackend(), atol=1e-5)


def test_torch_backend_mla_layout_bf16():
    check_mla_attention_backend(TorchAttentionBackend(), dtype=torch.bfloat16, atol=2e-2)


def test_mla_cache_shape_and_size():
    from framework.attention_backend import AttentionLayerConfig, MLAConfig

    mla = MLAConfig(kv_lora_rank=512, qk_rope_head_dim=64)  # DeepSeek-V2 / V2-Lite
    layer = AttentionLayerConfig(16, 1, mla.latent_size, 0.1, mla=mla)
    assert TorchAttentionBackend().layer_kv_cache_shape(layer, 10, 16) == (10, 16, 576)
    assert layer.kv_cache_layout == "mla" and layer.kv_elements_per_token == 576 and layer.output_size == 16 * 512


def test_torch_backend_sparse_mla_attends_to_the_selected_tokens_only():
    """DeepSeek Sparse Attention: each query over its topk_indices only, the rows' indexer tails untouched."""
    from framework.testing import check_sparse_mla_attention_backend

    check_sparse_mla_attention_backend(TorchAttentionBackend(), atol=1e-5)


def test_backends_without_sparse_mla_are_refused_for_sparse_layers():
    from framework.attention_backend import AttentionBackend, AttentionLayerConfig, MLAConfig
    from framework.engine.attention_choice import refusal_reasons
    from framework.platform import Platform
    from framework.specs import AttentionBackendSpec

    class DenseMLA(AttentionBackend):
        def forward(self, *args, **kwargs):
            raise AssertionError("never called")

    globals()["DenseMLA"] = DenseMLA
    spec = AttentionBackendSpec(name="dense_mla", impl=f"{__name__}:DenseMLA", kv_cache_layouts=("mla",))
    sparse = MLAConfig(32, 8, is_sparse=True, index_head_dim=16)
    layer = AttentionLayerConfig(4, 1, sparse.latent_size, 0.1, mla=sparse)
    dense = AttentionLayerConfig(4, 1, sparse.latent_size, 0.1, mla=MLAConfig(32, 8))
    cpu = Platform("cpu")
    assert refusal_reasons(spec, [dense, layer], "mla", "auto", torch.float32, cpu) == [
        "DeepSeek sparse attention (MLA with a lightning indexer's top-k) unsupported"
    ]
    assert refusal_reasons(spec, [dense], "mla", "auto", torch.float32, cpu) == []
    assert layer.kv_elements_per_token == 56 and TorchAttentionBackend().layer_kv_cache_shape(layer, 3, 16) == (
        3,
        16,
        56,
    )
    with pytest.raises(ValueError, match="must be sparse"):
        MLAConfig(32, 8, index_head_dim=16)


@pytest.mark.gpu
def test_torch_backend_sparse_mla_on_cuda():
    from framework.testing import check_sparse_mla_attention_backend

    check_sparse_mla_attention_backend(TorchAttentionBackend(), device="cuda", dtype=torch.bfloat16, atol=2e-2)


@pytest.mark.gpu
def test_torch_backend_mla_layout_on_cuda():
    check_mla_attention_backend(TorchAttentionBackend(), device="cuda", dtype=torch.bfloat16, atol=2e-2)


# decode-only steps (the batched path) of several shapes, besides the shared cases (prefills and
# soft caps take the reference path)
BATCHED_DECODE_CASES = [
    ("decode_gqa_ragged", [1, 1, 1, 1, 1], [0, 5, 16, 31, 200], 8, 2, 64, None, None),
    ("decode_sliding_window", [1, 1, 1], [4, 40, 90], 4, 1, 32, 9, None),
    ("decode_one_request", [1], [63], 6, 3, 16, None, None),
]


def test_batched_backend_matches_dense_attention_fp32():
    from fw_torch_attention.batched import BatchedTorchAttentionBackend

    from framework.testing import ATTENTION_CASES

    check_attention_backend(BatchedTorchAttentionBackend(), atol=1e-5, cases=ATTENTION_CASES + BATCHED_DECODE_CASES)


def test_batched_backend_matches_dense_attention_bf16():
    from fw_torch_attention.batched import BatchedTorchAttentionBackend

    check_attention_backend(BatchedTorchAttentionBackend(), dtype=torch.bfloat16, atol=2e-2, cases=BATCHED_DECODE_CASES)


def test_batched_backend_takes_decode_steps_in_one_sdpa_call(monkeypatch):
    import fw_torch_attention.batched as batched

    calls = []
    real = batched.F.scaled_dot_product_attention
    monkeypatch.setattr(
        batched.F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw)
    )
    check_attention_backend(batched.BatchedTorchAttentionBackend(), atol=1e-5, cases=BATCHED_DECODE_CASES[:1])
    assert calls == [(5, 8, 1, 64)]  # one call for the five requests' decode step


def test_cpu_engines_pick_the_batched_backend():
    from framework import registries

    spec = registries.attention_backends().get("torch_sdpa")
    assert spec.devices == ("cpu",) and spec.priority > registries.attention_backends().get("torch").priority


@pytest.mark.parametrize("kv_dtype", ["fp8", "turbo8", "turbo4", "turbo3"])
@pytest.mark.parametrize("backend_cls", ["torch", "torch_sdpa"])
def test_quantized_cache_attention_matches_dense_attention_on_the_dequantized_cache(backend_cls, kv_dtype):
    from framework import registries

    backend = registries.attention_backends().get(backend_cls).load()()
    check_attention_backend(backend, atol=1e-5, kv_dtype=kv_dtype)


def test_torch_backends_add_attention_sinks_to_the_softmax():
    from fw_torch_attention.batched import BatchedTorchAttentionBackend

    from framework.testing import ATTENTION_CASES

    check_attention_backend(TorchAttentionBackend(), atol=1e-5, with_sinks=True)
    # the batched backend's decode steps take the reference path when the layer has sinks
    check_attention_backend(
        BatchedTorchAttentionBackend(), atol=1e-5, cases=ATTENTION_CASES[2:4] + BATCHED_DECODE_CASES, with_sinks=True
    )


def test_backends_without_sinks_are_refused_for_layers_with_sinks():
    from framework import registries
    from framework.attention_backend import AttentionBackend, AttentionLayerConfig
    from framework.engine.attention_choice import refusal_reasons
    from framework.platform import Platform
    from framework.specs import AttentionBackendSpec

    class NoSinks(AttentionBackend):
        def forward(self, *args, **kwargs):
            raise AssertionError("never called")

    spec = AttentionBackendSpec(name="no_sinks", impl=f"{__name__}:NoSinks")
    sinks_layer = AttentionLayerConfig(8, 2, 64, 0.125, 128, has_sinks=True)
    cpu = Platform("cpu")
    globals()["NoSinks"] = NoSinks
    reasons = refusal_reasons(spec, [sinks_layer], "standard", "auto", torch.float32, cpu)
    assert reasons == ["attention sinks (gpt-oss) unsupported"]
    assert refusal_reasons(spec, [AttentionLayerConfig(8, 2, 64, 0.125)], "standard", "auto", torch.float32, cpu) == []
    torch_spec = registries.attention_backends().get("torch")
    assert refusal_reasons(torch_spec, [sinks_layer], "standard", "auto", torch.float32, cpu) == []


@pytest.mark.parametrize("backend_name", ["torch", "torch_sdpa"])
def test_torch_backends_keep_chunked_attention_within_each_chunk(backend_name):
    """Llama 4's chunked local attention: prefills across chunk borders, a chunk that starts inside
    the cached context, decodes just after and just before a border (torch_sdpa batches those)."""
    from framework import registries
    from framework.testing import CHUNKED_ATTENTION_CASES

    backend = registries.attention_backends().get(backend_name).load()()
    check_attention_backend(backend, atol=1e-5, cases=CHUNKED_ATTENTION_CASES)


@pytest.mark.parametrize("backend_name", ["torch", "torch_sdpa"])
def test_torch_backends_let_the_tokens_of_a_bidirectional_span_see_each_other(backend_name):
    """Gemma 3's image tokens: spans after a cached prefix, two in a sequence, one longer than the
    sliding window, decodes beside them (torch_sdpa takes the reference path for such steps)."""
    from framework import registries
    from framework.testing import BIDIRECTIONAL_SPAN_CASES

    backend = registries.attention_backends().get(backend_name).load()()
    check_attention_backend(backend, atol=1e-5, cases=BIDIRECTIONAL_SPAN_CASES)


def test_bidirectional_span_mask_differs_from_plain_causal():
    """The spans' oracle really widens the mask: a span's first token attends to its later ones."""
    from framework.testing import dense_attention, span_ends

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(8, 2, 16, generator=generator) for _ in range(3))
    ends = span_ends(0, 8, [(2, 6)])
    assert ends == [1, 2, 6, 6, 6, 6, 7, 8]
    causal, spans = dense_attention(q, k, v, 0.25), dense_attention(q, k, v, 0.25, key_ends=ends)
    assert torch.equal(causal[:2], spans[:2]) and torch.equal(causal[6:], spans[6:])
    assert (causal[2:5] - spans[2:5]).abs().amax() > 1e-2 and torch.allclose(causal[5], spans[5])


def test_backends_without_bidirectional_spans_are_refused_for_layers_that_need_them():
    from framework import registries
    from framework.attention_backend import AttentionBackend, AttentionLayerConfig
    from framework.engine.attention_choice import refusal_reasons
    from framework.platform import Platform
    from framework.specs import AttentionBackendSpec

    class NoSpans(AttentionBackend):
        def forward(self, *args, **kwargs):
            raise AssertionError("never called")

    globals()["NoSpans"] = NoSpans
    spec = AttentionBackendSpec(name="no_spans", impl=f"{__name__}:NoSpans")
    layer = AttentionLayerConfig(4, 2, 32, 0.2, has_bidirectional_spans=True)
    cpu = Platform("cpu")
    reasons = refusal_reasons(spec, [layer], "standard", "auto", torch.float32, cpu)
    assert reasons == ["bidirectional attention over an image's tokens (Gemma 3 vision) unsupported"]
    for name in ("torch", "torch_sdpa"):
        assert (
            refusal_reasons(registries.attention_backends().get(name), [layer], "standard", "auto", torch.float32, cpu)
            == []
        )


def test_chunked_attention_mask_differs_from_plain_causal():
    """The chunked cases' oracle really masks: the same inputs without the chunk rule differ."""
    from framework.testing import dense_attention

    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(20, 2, 16, generator=generator) for _ in range(3))
    chunked = dense_attention(query[-5:], key, value, 0.25, chunk_size=8)
    causal = dense_attention(query[-5:], key, value, 0.25)
    # positions 15..19: 15 is the last of chunk 1 and sees 8..15; 16.. start chunk 2
    windowed = dense_attention(query[-4:], key[16:], value[16:], 0.25)
    assert torch.allclose(chunked[1:], windowed) and not torch.allclose(chunked, causal, atol=1e-3)


def test_backends_without_chunked_attention_are_refused_for_chunked_layers():
    from framework import registries
    from framework.attention_backend import AttentionBackend, AttentionLayerConfig
    from framework.engine.attention_choice import refusal_reasons
    from framework.platform import Platform
    from framework.specs import AttentionBackendSpec

    class NoChunks(AttentionBackend):
        def forward(self, *args, **kwargs):
            raise AssertionError("never called")

    globals()["NoChunks"] = NoChunks
    spec = AttentionBackendSpec(name="no_chunks", impl=f"{__name__}:NoChunks")
    chunked, cpu = AttentionLayerConfig(8, 2, 64, 0.125, attention_chunk_size=8192), Platform("cpu")
    assert refusal_reasons(spec, [chunked], "standard", "auto", torch.float32, cpu) == [
        "chunked local attention (Llama 4 attention_chunk_size) unsupported"
    ]
    for name in ("torch", "torch_sdpa"):
        torch_spec = registries.attention_backends().get(name)
        assert refusal_reasons(torch_spec, [chunked], "standard", "auto", torch.float32, cpu) == []
