"""Quantized KV caches from a bf16 model: the Triton store writes the bytes ``framework.kv_quant``
writes (fp8 rounded to nearest even, also under the interpreter)."""

from __future__ import annotations

import pytest
import torch

from framework.attention_backend import AttentionLayerConfig
from framework.testing import interpreted, require_triton
from framework.testing.attention import allocate_test_cache

require_triton()

from fw_triton_attention.backend import TritonAttentionBackend  # noqa: E402
from fw_triton_attention.quant_tiles import quant_store  # noqa: E402

ON_CPU = pytest.param("cpu", marks=interpreted)
ON_CUDA = pytest.param("cuda", marks=pytest.mark.gpu)


def _e4m3_hard_cases() -> torch.Tensor:
    """Every finite e4m3 magnitude, the midpoints between neighbours (ties: to even), the midpoints
    one float32 ulp either side, and values below half the least subnormal; both signs, float32."""
    exact = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mids = (exact[1:] + exact[:-1]) / 2
    near = [mids, torch.nextafter(mids, exact[1:]), torch.nextafter(mids, exact[:-1])]
    tiny = torch.tensor([2.0**-11, 2.0**-10, 3 * 2.0**-11])  # below, at and above half of 2^-9
    values = torch.cat([exact, *near, tiny])
    return torch.cat([values, -values])


@pytest.mark.parametrize("device", [ON_CPU, ON_CUDA])
def test_fp8_rows_round_to_nearest_even_as_torch(device):
    # a checkpoint scale of 1 stores x itself: the kernel's float32 -> e4m3 conversion, bare
    values = _e4m3_hard_cases()
    head_size = 64
    rows = -(-values.numel() // head_size)
    values = torch.cat([values, torch.zeros(rows * head_size - values.numel())]).view(rows, 1, head_size)
    layer = AttentionLayerConfig(1, 1, head_size, head_size**-0.5)
    cache = allocate_test_cache(TritonAttentionBackend(), layer, "fp8", torch.float32, -(-rows // 16), 16, device)
    cache.k_scale = cache.v_scale = torch.ones(1, device=device)
    quant_store(values.to(device), values.to(device), cache, torch.arange(rows, device=device))
    stored = cache.data.view(-1, 1, 2 * head_size)[:rows, :, :head_size].cpu()
    expected = values.to(torch.float8_e4m3fn).view(torch.uint8)
    wrong = (stored != expected).nonzero()
    assert not len(wrong), f"{len(wrong)} codes differ from torch's, first at {values[tuple(wrong[0])].item()!r}"
