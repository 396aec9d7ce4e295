"""Quantized KV caches from a bf16 model: the Triton backend stores bit for bit what
``framework.kv_quant`` stores (rotated rows quantized from float32, fp8 rounded to nearest even,
also under the interpreter), and reads it back as dense attention over the dequantized cache.
"""

from __future__ import annotations

import pytest
import torch

from framework import kv_quant
from framework.attention_backend import AttentionLayerConfig
from framework.testing import ATTENTION_CASES, check_attention_backend, interpreted, require_triton
from framework.testing.attention import _step_metadata, allocate_test_cache

require_triton()

from fw_triton_attention.backend import TritonAttentionBackend  # noqa: E402
from fw_triton_attention.quant_tiles import quant_store  # noqa: E402

KV_DTYPES = ["fp8", "turbo8", "turbo4", "turbo3"]
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


@pytest.mark.parametrize("device", [ON_CPU, ON_CUDA])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_backend_stores_from_bf16_what_kv_quant_stores(kv_dtype, device):
    # bf16 rows over 9 octaves: fp8 ties (bf16 values over power-of-two scales), rotated turbo rows
    generator = torch.Generator().manual_seed(26)
    num_tokens, num_heads, num_kv_heads, head_size, block_size = 24, 4, 2, 32, 16
    spread = torch.exp2(torch.randint(-8, 1, (num_tokens, num_kv_heads, head_size), generator=generator).float())
    key, value = (torch.randn(num_tokens, num_kv_heads, head_size, generator=generator) * spread for _ in range(2))
    key, value = key.bfloat16(), value.bfloat16()
    query = torch.randn(num_tokens, num_heads * head_size, generator=generator).bfloat16()
    layer = AttentionLayerConfig(num_heads, num_kv_heads, head_size, head_size**-0.5)
    backend = TritonAttentionBackend()
    backend.initialize([layer], torch.bfloat16, block_size, torch.device(device))
    tables = [[2, 0], [1]]  # two requests of 17 and 7 tokens, blocks out of order
    cache = allocate_test_cache(backend, layer, kv_dtype, torch.bfloat16, 3, block_size, device)
    reference = allocate_test_cache(backend, layer, kv_dtype, torch.bfloat16, 3, block_size, device)
    _, metadata = _step_metadata({0: (0, 17), 1: (0, 7)}, tables, block_size, device)
    backend.prepare(metadata)
    backend.forward(layer, query.to(device), key.flatten(1).to(device), value.flatten(1).to(device), cache, metadata)
    kv_quant.store_quantized(reference, key.to(device), value.to(device), metadata.slot_mapping)
    differ = (cache.data != reference.data).sum().item()
    assert differ == 0, f"{kv_dtype}: {differ} of {cache.data.numel()} stored bytes differ from kv_quant's"
    assert torch.equal(cache.scales, reference.scales)


#: the GPU test's first case (a prefill from nothing, head 32, sequences of 7, 1 and 19 tokens),
#: where every turbo dtype failed while rotated rows were rounded to bf16 before quantizing
BF16_CASES = [ATTENTION_CASES[0]]


@interpreted
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_interpreted_kernels_read_bf16_quantized_caches_as_dense_attention(kv_dtype):
    # the GPU test's tolerance: bf16 inputs and outputs, and (turbo) the query and the output
    # rounded to bf16 in the rotated space, around the float64 oracle on the dequantized cache
    check_attention_backend(
        TritonAttentionBackend(num_sms=64),
        device="cpu",
        dtype=torch.bfloat16,
        atol=3e-2,
        cases=BF16_CASES,
        kv_dtype=kv_dtype,
    )
