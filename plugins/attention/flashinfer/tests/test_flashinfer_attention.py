"""The FlashInfer backend: host-side paging and selection on CPU; against dense attention and the
Triton backend on CUDA (``gpu`` marker: FlashInfer's kernels compile there just in time)."""

from __future__ import annotations

import pytest
import torch
import transformers
from fw_flashinfer_attention.backend import FlashInferAttentionBackend
from fw_flashinfer_attention.paging import paged_kv_from_block_table

from framework import LLM, SamplingParams, registries
from framework.attention_backend import AttentionLayerConfig
from framework.errors import ConfigError
from framework.platform import Platform
from framework.testing import ATTENTION_CASES, check_attention_backend, write_tiny_model


def test_paged_kv_lists_each_requests_pages_in_order():
    table = torch.tensor([[7, 3, 0, 0], [5, 1, 9, 0], [2, 0, 0, 0]], dtype=torch.int32)
    paged = paged_kv_from_block_table(torch.tensor([12, 17, 8]), table, block_size=8)
    assert paged.indptr.tolist() == [0, 2, 5, 6]
    assert paged.indices.tolist() == [7, 3, 5, 1, 9, 2]
    assert paged.last_page_len.tolist() == [4, 1, 8]
    assert {t.dtype for t in paged} == {torch.int32}


def test_registered_and_unavailable_without_cuda_with_reasons():
    spec = registries.attention_backends().get("flashinfer")
    assert spec.load() is FlashInferAttentionBackend
    assert spec.priority < registries.attention_backends().get("triton").priority
    assert any("cuda" in r for r in spec.unavailable_reasons(Platform("cpu", packages=frozenset({"flashinfer"}))))
    hopper = Platform("cuda", num_devices=1, compute_capability=(9, 0), packages=frozenset({"flashinfer"}), probed=True)
    assert spec.unavailable_reasons(hopper) == []
    missing = Platform("cuda", num_devices=1, compute_capability=(9, 0), probed=True)
    assert any("flashinfer" in r for r in spec.unavailable_reasons(missing))


def test_mla_models_are_refused_with_the_layout_reason_so_triton_runs_them():
    from framework.attention_backend import MLAConfig
    from framework.engine.attention_choice import refusal_reasons

    hopper = Platform(
        "cuda", num_devices=1, compute_capability=(9, 0), packages=frozenset({"flashinfer", "triton"}), probed=True
    )
    layers = [AttentionLayerConfig(16, 1, 576, 0.1, mla=MLAConfig(512, 64))]  # DeepSeek-V2-Lite
    spec = registries.attention_backends().get("flashinfer")
    assert refusal_reasons(spec, layers, "mla", "auto", torch.bfloat16, hopper) == [
        "KV layout 'mla' unsupported (it reads: standard)"
    ]
    triton = registries.attention_backends().get("triton")
    assert refusal_reasons(triton, layers, "mla", "auto", torch.bfloat16, hopper) == []


def test_validate_names_unsupported_head_size_gqa_and_kv_dtype():
    layers = [AttentionLayerConfig(6, 4, 80, 0.1)]
    reasons = FlashInferAttentionBackend.validate(layers, "fp8", None)
    assert any("head size 80" in r for r in reasons)
    assert any("not a multiple" in r for r in reasons)
    assert any("fp8" in r for r in reasons)
    assert FlashInferAttentionBackend.validate([AttentionLayerConfig(32, 8, 128, 0.1)], "auto", None) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_requesting_flashinfer_on_cpu_is_a_clear_error(tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
    )
    write_tiny_model(tmp_path, config)
    with pytest.raises(ConfigError, match="attention backend 'flashinfer' cannot run: needs device cuda"):
        LLM(str(tmp_path), device="cpu", attention_backend="flashinfer")


# --- on the GPU -------------------------------------------------------------------------------

#: The shared cases with head sizes FlashInfer supports, plus GQA 1/4/8 at Llama shapes and long decode.
GPU_CASES = [case for case in ATTENTION_CASES if case[5] in (64, 128, 256)] + [
    ("prefill_gqa1_h128", [33, 7, 100], [0, 0, 0], 8, 8, 128, None, None),
    ("prefill_prefix_gqa4_h128", [17, 64, 3], [100, 31, 500], 32, 8, 128, None, None),
    ("prefill_prefix_gqa8_h128", [9, 1, 40], [16, 2000, 0], 32, 4, 128, None, None),
    ("decode_short_gqa4", [1] * 6, [1, 5, 16, 17, 200, 63], 32, 8, 128, None, None),
    ("decode_long_gqa8", [1] * 4, [8191, 16000, 3, 32767], 32, 4, 128, None, None),
    ("decode_gqa1_h64", [1] * 3, [100, 1000, 4000], 8, 8, 64, None, None),
    ("decode_h256_window_softcap", [1] * 3, [300, 4100, 20], 8, 4, 256, 256, 50.0),
    ("prefill_h256_window_softcap", [20, 1], [700, 30], 8, 4, 256, 256, 50.0),
]


@pytest.mark.gpu
def test_matches_dense_attention_on_cuda_bf16():
    check_attention_backend(
        FlashInferAttentionBackend(), device="cuda", dtype=torch.bfloat16, atol=2e-2, cases=GPU_CASES
    )


def _greedy(path, prompts, **engine_args):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    llm = LLM(str(path), device="cuda", dtype="bf16", num_blocks=256, **engine_args)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return llm, [r.outputs[0].token_ids for r in outputs]


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_greedy_tokens_match_the_triton_backend(tmp_path, family):
    # bf16 on both backends: a wide initialisation makes the logits peaked, so greedy choices are
    # not near-ties that any change of summation order flips
    if family == "llama":
        config = transformers.LlamaConfig(
            vocab_size=256,
            hidden_size=512,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=64,
            max_position_embeddings=1024,
            initializer_range=0.4,
        )
    else:  # sliding window on alternate layers and attention soft-capping
        config = transformers.Gemma2Config(
            vocab_size=256,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=128,
            max_position_embeddings=1024,
            sliding_window=48,
            attn_logit_softcapping=50.0,
            initializer_range=0.4,
        )
    write_tiny_model(tmp_path, config)
    prompts = [
        [int(t) for t in torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(n))]
        for n in (5, 37, 100, 300)
    ]
    flashinfer, fi_ids = _greedy(tmp_path, prompts, attention_backend="flashinfer")
    assert flashinfer.engine.attention_backend == "flashinfer"
    assert "decode graphs" in flashinfer.engine.summary["cuda_graphs"]
    _, eager_ids = _greedy(tmp_path, prompts, attention_backend="flashinfer", enable_cuda_graphs=False)
    _, triton_ids = _greedy(tmp_path, prompts, attention_backend="triton")
    assert fi_ids == eager_ids
    assert fi_ids == triton_ids
