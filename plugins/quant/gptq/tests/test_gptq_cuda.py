"""On the GPU machine: the conformance kits in CUDA graphs for the main formats, the kernel without
host syncs and replayed from a graph, and a tiny GPTQ model through the engine with CUDA graphs
giving the tokens of the eager engine and of transformers on the dequantized weights."""

from __future__ import annotations

import pytest
import torch
import transformers
from schemes import FormatScheme
from tiny_checkpoints import quantize_checkpoint

from framework.testing import check_linear_method, check_moe_method, check_no_sync_and_cuda_graph_replay

pytestmark = pytest.mark.gpu

CUDA_SCHEMES = [
    FormatScheme("gptq", 4, 128),
    FormatScheme("gptq", 4, 32, symmetric=False, act_order=True),
    FormatScheme("awq", 4, 128, symmetric=False),
    FormatScheme("compressed", 8, -1),
]


@pytest.mark.parametrize("scheme", CUDA_SCHEMES, ids=repr)
def test_linear_method_passes_the_conformance_kit_in_cuda_graphs(scheme):
    check_linear_method(scheme, device="cuda", tp_sizes=(1, 2), num_rows=(1, 3, 16, 64, 512))


def test_moe_method_passes_the_conformance_kit_in_cuda_graphs():
    check_moe_method(FormatScheme("gptq", 4, 128), device="cuda", tp_sizes=(1, 2), num_experts=8)


@pytest.mark.parametrize("rows", [1, 8, 64])
def test_kernel_makes_no_host_sync_and_replays_from_a_graph(rows):
    from fw_gptq.kernels.layout import dequantize_kernel_weight, to_kernel_layout
    from fw_gptq.kernels.wna16 import wna16_matmul
    from fw_gptq.packing import IntWeight
    from reference_formats import random_int_weight

    q, scales, zeros, g_idx, w = random_int_weight(4096, 4096, 4, 128, False, True, torch.Generator().manual_seed(0))
    on_cpu = IntWeight(q.to(torch.uint8), scales, zeros.to(torch.uint8), g_idx, 4, 128)
    weight = to_kernel_layout(
        IntWeight(*(t.cuda() if isinstance(t, torch.Tensor) else t for t in on_cpu)), torch.bfloat16
    )
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    expected = x.float() @ dequantize_kernel_weight(weight, torch.float32).t()
    got = wna16_matmul(x, weight).float()
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 2e-2
    check_no_sync_and_cuda_graph_replay(
        lambda a: wna16_matmul(a, weight), [x], lambda: [torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)]
    )


def test_tiny_gptq_model_with_cuda_graphs_gives_the_eager_tokens(tmp_path):
    from framework import LLM, SamplingParams

    config = transformers.LlamaConfig(
        vocab_size=160,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.1,
    )
    from framework.testing import write_tiny_model

    reference = write_tiny_model(tmp_path, config)
    quantize_checkpoint(tmp_path, reference, FormatScheme("gptq", 4, 128, act_order=True))
    prompts = [{"prompt_token_ids": [5, 9, 33, 2, 71]}, {"prompt_token_ids": list(range(40, 59))}]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    runs = []
    for graphs in (True, False):
        with LLM(str(tmp_path), device="cuda", dtype="bf16", num_blocks=32, enable_cuda_graphs=graphs) as llm:
            runs.append([r.outputs[0].token_ids for r in llm.generate(prompts, params)])
    assert runs[0] == runs[1]


LLAMA3_8B = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "head": (128256, 4096),
}


@pytest.mark.parametrize("bits, asymmetric", [(4, False), (4, True), (8, False)], ids=["gptq4", "awq4", "gptq8"])
def test_int8_gemv_at_the_llama3_8b_shapes_is_its_reference_deterministic_and_graph_safe(bits, asymmetric, monkeypatch):
    """The one-row default (the integer GEMV) at every Llama-3-8B shape, at its default setting (split-K
    on the small ones): its reference's values, the same bits on a second run, no host sync, graph replay."""
    from fw_gptq.kernels.gemv_int8 import gemv_setting, int8_gemv, quantize_x_reference
    from fw_gptq.kernels.layout import dequantize_kernel_weight, to_kernel_layout
    from fw_gptq.kernels.wna16 import int8_gemv_chosen, wna16_matmul
    from fw_gptq.packing import IntWeight

    monkeypatch.setenv("FW_GPTQ_GEMV", "int8")  # whatever the default is now
    generator = torch.Generator("cuda").manual_seed(bits)
    splits = set()
    for n, k in LLAMA3_8B.values():
        q = torch.randint(0, 2**bits, (k, n), device="cuda", generator=generator, dtype=torch.int32).to(torch.uint8)
        scales = 1e-3 + 1e-2 * torch.rand(k // 128, n, device="cuda", generator=generator)
        zeros = torch.randint(0, 2**bits, (k // 128, n), device="cuda", generator=generator, dtype=torch.int32)
        zeros = zeros.to(torch.uint8) if asymmetric else None
        weight = to_kernel_layout(IntWeight(q, scales, zeros, None, bits, 128), torch.bfloat16)
        del q
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=generator)
        assert int8_gemv_chosen(weight, x)
        splits.add(gemv_setting(weight, x.device).split_k)
        expected = quantize_x_reference(x) @ dequantize_kernel_weight(weight, torch.float32).t()
        got = wna16_matmul(x, weight)
        error = ((got.float() - expected).abs().max() / expected.abs().max()).item()
        assert error < 1e-2, (n, k, error)  # bf16 outputs of fp32 sums
        assert torch.equal(got, int8_gemv(x, weight))  # split-K sums in a fixed order
        check_no_sync_and_cuda_graph_replay(
            lambda a, weight=weight: wna16_matmul(a, weight),
            [x],
            lambda k=k: [torch.randn(1, k, device="cuda", dtype=torch.bfloat16)],
        )
        del weight, expected
        torch.cuda.empty_cache()
    assert len(splits) > 1  # split and unsplit launches both ran
