"""The reference backend against dense attention on unpaged tensors (many shapes)."""

import pytest
import torch
from fw_torch_attention.backend import TorchAttentionBackend

from framework.testing import check_attention_backend


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
