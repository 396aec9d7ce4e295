"""The ``linear`` op's Triton GEMV (``fw_triton_ops.gemv``) against ``F.linear``: interpreted on CPU
(fp32), compiled on CUDA (bf16/fp16, against float32 math); the registry ranks it below the
default on CUDA, the GEMV for one row at the shapes measured faster; layers and a tiny model run it
(forced by ``FW_KERNELS`` on CPU, where the interpreter runs it)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from framework import LLM, SamplingParams, ops, registries
from framework.platform import Platform
from framework.testing import (
    PARITY_PROMPTS,
    capture_logits,
    check_greedy_parity,
    check_kernels_used,
    check_no_sync_and_cuda_graph_replay,
    count_kernel_calls,
    interpreted,
    reference_logits,
    require_triton,
    write_tiny_model,
)

require_triton()

import fw_triton_ops.gemv as gemv_module  # noqa: E402
from fw_triton_ops.gemv import GemvConfig, gemv, gemv_config, linear, linear_config  # noqa: E402

FP32_TOL = {"rtol": 1e-5, "atol": 1e-5}


def _randn(*shape, seed=0, device="cpu", dtype=torch.float32, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=dtype)


def _inputs(rows, n, k, device="cpu", dtype=torch.float32, seed=0):
    """``x [rows, k]``, ``weight [n, k]`` scaled as a layer's (outputs of order 1), ``bias [n]``."""
    return (
        _randn(rows, k, seed=seed, device=device, dtype=dtype),
        _randn(n, k, seed=seed + 1, device=device, dtype=dtype, scale=k**-0.5),
        _randn(n, seed=seed + 2, device=device, dtype=dtype),
    )


@pytest.fixture
def gemv_calls(monkeypatch):
    """Counts the GEMV launches of :func:`linear` (a fall-through to ``F.linear`` adds none)."""
    calls = []

    def counting_gemv(*args, **kwargs):
        calls.append(args[3])  # the config
        return gemv(*args, **kwargs)

    monkeypatch.setattr(gemv_module, "gemv", counting_gemv)
    return calls


# --- interpreted on CPU, fp32 ---------------------------------------------------------------------------------


@interpreted
@pytest.mark.parametrize("split_k", [1, 2, 4])
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize("n, k", [(40, 96), (33, 130)], ids=["40x96", "33x130"])
def test_gemv_matches_f_linear_fp32_with_and_without_bias(n, k, rows, split_k):
    x, weight, bias = _inputs(rows, n, k, seed=rows)
    config = GemvConfig(block_n=16, block_k=32, split_k=split_k, num_warps=4)
    for b in (None, bias):
        out = gemv(x, weight, b, config)
        assert out.shape == (rows, n) and out.dtype == x.dtype
        torch.testing.assert_close(out, F.linear(x, weight, b), **FP32_TOL)


@interpreted
def test_a_split_whose_columns_lie_past_k_contributes_nothing():
    # K = 40 in blocks of 32 over 4 splits: splits 0 and 1 hold 32 + 8 columns, 2 and 3 none
    x, weight, bias = _inputs(3, 24, 40)
    out = gemv(x, weight, bias, GemvConfig(block_n=16, block_k=32, split_k=4, num_warps=4))
    torch.testing.assert_close(out, F.linear(x, weight, bias), **FP32_TOL)


@interpreted
@pytest.mark.parametrize("shape", [(1, 96), (1, 1, 96), (1, 1, 1, 96)], ids=str)
def test_linear_flattens_leading_dimensions(shape, gemv_calls):
    x = _randn(*shape, seed=3)
    _, weight, bias = _inputs(1, 40, 96, seed=4)
    out = linear(x, weight, bias)
    assert out.shape == (*shape[:-1], 40)
    torch.testing.assert_close(out, F.linear(x, weight, bias), **FP32_TOL)
    assert len(gemv_calls) == 1


@interpreted
def test_linear_runs_the_rules_two_way_split_at_one_row(gemv_calls):
    x, weight, bias = _inputs(1, 48, 4096, seed=5)  # a narrow, deep layer: the rule splits K
    torch.testing.assert_close(linear(x, weight, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    assert gemv_calls == [gemv_config(48, 4096, 1)] and gemv_calls[0].split_k == 2 and gemv_calls[0].tensor_cores


@interpreted
def test_linear_reads_strided_rows_and_a_weight_row_slice(gemv_calls):
    base = _randn(1, 2 * 96, seed=6)
    x = base[:, ::2]  # column stride 2: copied to unit stride
    weight = _randn(80, 96, seed=7)[20:60]  # a row slice: unit column stride, read in place
    torch.testing.assert_close(linear(x, weight), F.linear(x, weight), **FP32_TOL)
    assert len(gemv_calls) == 1


@interpreted
def test_linear_falls_through_to_f_linear_outside_its_cases(gemv_calls):
    _, weight, bias = _inputs(1, 40, 96, seed=8)
    cases = {
        "two rows": (_randn(2, 96, seed=9), weight, bias),
        "no rows": (torch.empty(0, 96), weight, bias),
        "a transposed weight": (_randn(1, 96, seed=9), _randn(96, 40, seed=10).t(), None),
        "bf16 under the interpreter": (_randn(1, 96, seed=9, dtype=torch.bfloat16), weight.bfloat16(), None),
        "float64": (_randn(1, 96, seed=9, dtype=torch.float64), weight.double(), bias.double()),
        "a weight that needs gradients": (_randn(1, 96, seed=9), weight.clone().requires_grad_(), bias),
    }
    for name, (x, w, b) in cases.items():
        out = linear(x, w, b)
        assert torch.equal(out, F.linear(x, w, b)), name
    assert gemv_calls == []
    with pytest.raises(RuntimeError):  # F.linear's own error for mismatched shapes
        linear(_randn(1, 95), weight)


def test_rule_at_one_row_takes_tensor_cores_and_splits_k_only_for_narrow_deep_layers():
    """The one-row rule (H200, 132 SMs): BLOCK_N by N, K split in two under 66 N blocks from K = 2048;
    2-8 rows keep their rule (no split)."""
    assert gemv_config(3072, 4096, 1, 132) == GemvConfig(32, 256, 1, 4, tensor_cores=True)  # 96 N blocks
    assert gemv_config(1024, 3072, 1, 132) == GemvConfig(32, 256, 2, 4, tensor_cores=True)  # 32 N blocks
    assert gemv_config(25600, 5120, 1, 132) == GemvConfig(128, 256, 1, 4, tensor_cores=True)
    assert gemv_config(5120, 1024, 1, 132) == GemvConfig(64, 256, 1, 4, tensor_cores=True)
    assert gemv_config(1024, 1024, 1, 132).split_k == 1  # K under 2048: no split
    assert gemv_config(4096, 7168, 1, 132).split_k == 1  # 128 N blocks fill half the SMs
    assert gemv_config(1024, 3072, 1, 16).split_k == 1  # a GPU of 16 SMs: 32 blocks fill it
    assert gemv_config(5120, 5120, 8, 132) == GemvConfig(64, 256, 1, 4)
    assert gemv_config(25600, 5120, 2, 132) == GemvConfig(128, 256, 1, 4)


def test_linear_takes_the_measured_setting_of_its_gpu_and_cublas_where_the_table_says_so(monkeypatch, gemv_calls):
    """On an H200 the table's shapes take their measured setting, or cuBLAS (None); other shapes,
    and other GPUs, the rule."""
    from fw_triton_ops.gemv_tuned import TUNED_ONE_ROW

    h200 = TUNED_ONE_ROW["NVIDIA H200"]
    assert h200[(5120, 5120)] is None and h200[(25600, 5120)] == GemvConfig(128, 256, 1, 4, tensor_cores=True)
    cpu = torch.device("cpu")
    assert linear_config(25600, 5120, cpu) == gemv_config(25600, 5120, 1)  # "cpu" has no table
    monkeypatch.setattr(gemv_module, "_device_name", lambda device: "NVIDIA H200")
    assert linear_config(5120, 5120, cpu) is None
    assert linear_config(25600, 5120, cpu) == h200[(25600, 5120)]
    assert linear_config(48, 96, cpu) == gemv_config(48, 96, 1)
    cuda = torch.device("cuda")  # _measured_gpu asks only the (patched) device name
    assert gemv_module._measured_gpu.__wrapped__(cuda)
    monkeypatch.setattr(gemv_module, "_device_name", lambda device: "NVIDIA A100-SXM4-80GB")
    assert not gemv_module._measured_gpu.__wrapped__(cuda)  # a GPU without a table keeps cuBLAS


@interpreted
def test_linear_calls_f_linear_where_the_table_says_cublas(monkeypatch, gemv_calls):
    from fw_triton_ops.gemv_tuned import TUNED_ONE_ROW

    monkeypatch.setattr(gemv_module, "_device_name", lambda device: "NVIDIA H200")
    x, weight, bias = _inputs(1, 40, 96, seed=14)
    linear(x, weight, bias)
    assert len(gemv_calls) == 1  # the rule's setting: (40, 96) is not in the table
    monkeypatch.setitem(TUNED_ONE_ROW, "NVIDIA H200", {**TUNED_ONE_ROW["NVIDIA H200"], (40, 96): None})
    assert torch.equal(linear(x, weight, bias), F.linear(x, weight, bias)) and len(gemv_calls) == 1


# --- registry and layers ----------------------------------------------------------------------------------------


def test_registry_chooses_the_gemv_linear_on_cuda_and_the_reference_on_cpu():
    platform = Platform("cuda", compute_capability=(9, 0), packages=frozenset({"triton"}))
    registry = registries.kernels(platform)
    spec = registry.select("linear", platform)
    assert spec.name == "triton" and spec.priority > registry.get("linear/torch").priority
    assert spec.load() is linear
    cpu = Platform("cpu", packages=frozenset({"triton"}))
    assert registries.kernels(cpu).select("linear", cpu).name == "torch"


def test_linear_layers_resolve_the_op_once_through_the_registry(monkeypatch, gemv_calls):
    from framework.layers import ReplicatedLinear

    default = ReplicatedLinear(96, 40, bias=True)
    monkeypatch.setenv("FW_KERNELS", "linear=triton")
    forced = ReplicatedLinear(96, 40, bias=True)
    assert default.linear_method.linear is ops.linear and forced.linear_method.linear is gemv_module.linear
    with torch.no_grad():
        for layer in (default, forced):
            layer.weight.copy_(_randn(40, 96, seed=11))
            layer.bias.copy_(_randn(40, seed=12))
    x = _randn(1, 96, seed=13)
    monkeypatch.delenv("FW_KERNELS")  # resolved at construction: the environment no longer matters
    expected = F.linear(x, default.weight, default.bias)
    torch.testing.assert_close(default(x), expected, rtol=0, atol=0)
    if os.environ.get("TRITON_INTERPRET") == "1":
        torch.testing.assert_close(forced(x), expected, **FP32_TOL)
        assert len(gemv_calls) == 1


TINY_LLAMA = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,
)


@interpreted
def test_tiny_llama_greedy_ids_match_transformers_with_the_triton_linear(one_thread, tmp_path, monkeypatch, gemv_calls):
    """Forced by name and interpreted: every linear layer and the LM head run the GEMV for one
    request's decode steps (one row) and ``F.linear`` for prefill chunks; the greedy ids are
    transformers'."""
    import transformers

    reference = write_tiny_model(tmp_path, transformers.LlamaConfig(**TINY_LLAMA))
    monkeypatch.setenv("FW_KERNELS", "linear=triton")
    with count_kernel_calls() as calls:
        check_greedy_parity(tmp_path, reference, PARITY_PROMPTS[2:], steps=4, device="cpu")
    check_kernels_used(calls, {"linear": "triton"})
    # the 3 decode steps of the one request: one row, 2 x 4 layers + the LM head
    assert len(gemv_calls) >= 3 * 9


# --- compiled on CUDA -------------------------------------------------------------------------------------------

#: (N, K): Llama-3-8B at TP=2 (QKV, O, gate/up, down), Qwen3-32B's QKV at TP=2, and an odd one
MODEL_SHAPES = [(3072, 4096), (4096, 2048), (14336, 4096), (4096, 7168), (5120, 5120), (1000, 1000)]


def _errors_against_fp32(out, x, weight, bias):
    """(error of ``out``, error of the same-dtype ``F.linear``, largest magnitude), against float32 math."""
    expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    torch_out = F.linear(x, weight, bias).float()
    return (
        (out.float() - expected).abs().max().item(),
        (torch_out - expected).abs().max().item(),
        expected.abs().max().item(),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize("n, k", MODEL_SHAPES, ids=lambda v: str(v))
def test_compiled_linear_matches_float32_math_on_cuda(n, k, rows, dtype, gemv_calls):
    x, weight, bias = _inputs(rows, n, k, device="cuda", dtype=dtype, seed=rows)
    for b in (None, bias):
        out = linear(x, weight, b)
        assert out.shape == (rows, n) and out.dtype == dtype
        error, torch_error, scale = _errors_against_fp32(out, x, weight, b)
        assert error <= 2 * torch_error + 1e-3 * scale, (error, torch_error, scale)
    # one row on a GPU with measured settings runs the GEMV unless the table gives the shape to cuBLAS
    runs = gemv_module.takes(x, weight, None) and linear_config(n, k, x.device) is not None
    assert len(gemv_calls) == (2 if runs else 0)


@pytest.mark.gpu
@pytest.mark.parametrize("split_k", [1, 2, 4])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_compiled_gemv_every_split_matches_float32_math_on_cuda(rows, split_k):
    x, weight, bias = _inputs(rows, 4096, 7168, device="cuda", dtype=torch.bfloat16, seed=split_k)
    for block_n, block_k, warps, tensor_cores in ((32, 128, 8, False), (64, 128, 4, False), (64, 256, 4, True)):
        out = gemv(x, weight, bias, GemvConfig(block_n, block_k, split_k, warps, tensor_cores=tensor_cores))
        error, torch_error, scale = _errors_against_fp32(out, x, weight, bias)
        assert error <= 2 * torch_error + 1e-3 * scale, (block_n, tensor_cores, error, torch_error, scale)


@pytest.mark.gpu
def test_compiled_linear_falls_through_for_fp32_and_more_rows_on_cuda(gemv_calls):
    x, weight, bias = _inputs(2, 3072, 4096, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(linear(x, weight, bias), F.linear(x, weight, bias))
    x, weight, bias = _inputs(1, 3072, 4096, device="cuda")
    assert torch.equal(linear(x, weight, bias), F.linear(x, weight, bias))
    assert gemv_calls == []


def _decode_layers_inputs(seed):
    """One row through a split-K layer (Llama-3-8B TP=2 QKV) and 8 rows through gate/up, with biases."""
    one, qkv, qkv_bias = _inputs(1, 3072, 4096, device="cuda", dtype=torch.bfloat16, seed=seed)
    eight, gate_up, gate_up_bias = _inputs(8, 14336, 4096, device="cuda", dtype=torch.bfloat16, seed=seed + 3)
    return one, qkv, qkv_bias, eight, gate_up, gate_up_bias


@pytest.mark.gpu
def test_compiled_linear_does_not_sync_and_replays_in_a_cuda_graph(gemv_calls):
    def run(one, qkv, qkv_bias, eight, gate_up, gate_up_bias):
        return linear(one, qkv, qkv_bias), linear(eight, gate_up, gate_up_bias), linear(one, qkv)

    qkv = linear_config(3072, 4096, torch.device("cuda"))
    if not gemv_module._measured_gpu(torch.device("cuda")):
        pytest.skip(f"no measured GEMV settings for {torch.cuda.get_device_name()}: linear keeps cuBLAS there")
    if qkv is None or qkv.split_k == 1:
        pytest.skip("this GPU's setting does not split the QKV layer; the graph would not cover the sum kernel")
    check_no_sync_and_cuda_graph_replay(run, _decode_layers_inputs(seed=10), lambda: _decode_layers_inputs(seed=20))
    assert gemv_calls


@pytest.mark.gpu
def test_tiny_llama_bf16_with_the_triton_linear_in_cuda_graphs_is_as_close_to_transformers_as_cublas(
    tmp_path, monkeypatch, gemv_calls
):
    """The engine in bf16 with CUDA graphs (one request at a time: its one-row decode steps replay
    the GEMV), once with ``FW_KERNELS=linear=triton`` and once with cuBLAS: every logit each
    computes, compared with transformers' float32 logits of the same ids, is as close with the GEMV
    as with cuBLAS."""
    import transformers

    if not gemv_module._measured_gpu(torch.device("cuda")):
        pytest.skip(f"no measured GEMV settings for {torch.cuda.get_device_name()}: linear keeps cuBLAS there")
    config = transformers.LlamaConfig(**{**TINY_LLAMA, "hidden_size": 256, "intermediate_size": 512})
    reference = write_tiny_model(tmp_path, config)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def worst_error(kernels: str) -> float:
        monkeypatch.setenv("FW_KERNELS", kernels)
        with count_kernel_calls() as calls:
            llm = LLM(str(tmp_path), device="cuda", dtype="bf16", num_blocks=64)
            assert "decode graphs" in llm.engine.summary["cuda_graphs"]
            records = capture_logits(llm)
            results = [llm.generate([{"prompt_token_ids": p}], params)[0] for p in PARITY_PROMPTS]
        check_kernels_used(calls, {"linear": kernels.partition("=")[2]})
        worst = 0.0
        for index, (prompt, result) in enumerate(zip(PARITY_PROMPTS, results, strict=True)):
            ids = prompt + result.outputs[0].token_ids
            expected = reference_logits(reference, ids[:-1])
            got = torch.stack([records[(f"{index}-0", pos)] for pos in range(len(ids) - 1)]).cpu()
            worst = max(worst, ((got - expected).abs().max() / expected.abs().max()).item())
        llm.close()
        return worst

    triton_error = worst_error("linear=triton")
    assert gemv_calls  # the GEMV ran (eager steps and graph captures), not only its fall-through
    assert triton_error <= 2 * worst_error("linear=torch") + 1e-3
