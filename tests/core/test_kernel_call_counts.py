"""``framework.testing.count_kernel_calls`` / ``check_kernels_used``: which implementation of each
op an engine ran, so that a GPU test fails when a Triton kernel silently falls back to torch.

On the CPU a fake kernel plugin (priority 10, deferring to the torch reference) stands in for
Triton: the counts must name it, and forcing the reference (``FW_KERNELS``) must fail the check.
"""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from framework import LLM, SamplingParams, hookimpl, ops
from framework.layers import RMSNorm
from framework.layers.rotary import get_rope
from framework.specs import KernelSpec
from framework.testing import check_kernels_used, count_kernel_calls

FAKE_OPS = ("rms_norm", "fused_add_rms_norm")
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def fake_kernels(monkeypatch, register_fw_plugin):
    """``rms_norm`` and ``fused_add_rms_norm`` by a plugin named ``fake`` that outranks the reference."""
    module = types.ModuleType("fw_fake_counted_kernels")
    for op in FAKE_OPS:
        setattr(module, op, getattr(ops, op))
    monkeypatch.setitem(sys.modules, module.__name__, module)

    class FakeKernels:
        @hookimpl
        def register_kernels(self):
            return [KernelSpec(op=op, name="fake", impl=f"{module.__name__}:{op}", priority=10) for op in FAKE_OPS]

    register_fw_plugin(FakeKernels(), name="fake-kernels")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    return folder


def generate_a_few_tokens(folder, **engine_args) -> list[int]:
    llm = LLM(str(folder), load_format="dummy", num_blocks=16, **engine_args)
    result = llm.generate(
        {"prompt_token_ids": [3, 17, 9, 40]}, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    )
    return result[0].outputs[0].token_ids


def test_counts_name_the_implementation_each_op_and_the_attention_backend_ran(fake_kernels, tiny_llama):
    with count_kernel_calls() as calls:
        assert len(generate_a_few_tokens(tiny_llama)) == 3
    # 3 steps (one prefill, two decodes) x 2 layers: attention, rotary and SwiGLU once per layer and step
    # (the CPU's attention backend is torch_sdpa: decode steps batched into one SDPA call)
    assert calls["attention/torch_sdpa"] == calls["rotary_embedding/torch"] == calls["silu_and_mul/torch"] == 6
    # per step: the first layer's input norm has no residual (rms_norm); the other three norms add it
    assert calls["rms_norm/fake"] == 3 and calls["fused_add_rms_norm/fake"] == 12
    assert "rms_norm/torch" not in calls and "fused_add_rms_norm/torch" not in calls
    check_kernels_used(
        calls,
        {
            "rms_norm": "fake",
            "fused_add_rms_norm": "fake",
            "silu_and_mul": "torch",
            "rotary_embedding": "torch",
            "attention": "torch_sdpa",
        },
    )


def test_a_fallback_to_the_reference_fails_the_check(fake_kernels, tiny_llama, monkeypatch):
    monkeypatch.setenv("FW_KERNELS", "rms_norm=torch")  # as if the fast rms_norm could not be used
    with count_kernel_calls() as calls:
        generate_a_few_tokens(tiny_llama)
    check_kernels_used(calls, {"fused_add_rms_norm": "fake"})
    with pytest.raises(AssertionError, match=r"rms_norm: expected only 'fake' to run, ran \{'torch': \d+\}"):
        check_kernels_used(calls, {"rms_norm": "fake", "fused_add_rms_norm": "fake"})


def test_an_op_that_never_ran_fails_the_check(fake_kernels):
    with count_kernel_calls() as calls:
        RMSNorm(8)(torch.randn(2, 8))
    assert dict(calls) == {"rms_norm/fake": 1}
    with pytest.raises(AssertionError, match="fused_moe: expected only 'triton' to run, ran nothing"):
        check_kernels_used(calls, {"rms_norm": "fake", "fused_moe": "triton"})


def test_select_picks_the_best_spec_or_the_named_one(fake_kernels):
    """``kernels._select`` is the one rule: ``_resolve`` loads its spec, the counts use its key."""
    from framework import kernels

    best, named = kernels._select("rms_norm", None, None), kernels._select("rms_norm", "torch", None)
    assert (best.key, best.impl) == ("rms_norm/fake", "fw_fake_counted_kernels:rms_norm")
    assert named.key == "rms_norm/torch" and named.impl != best.impl


def test_layers_built_outside_the_block_are_not_counted_and_shared_rotary_modules_are_rebuilt():
    from framework import kernels

    norm, rope = RMSNorm(8), get_rope(8, 8, 32, 10000.0)
    resolve = kernels._resolve
    with count_kernel_calls() as calls:
        norm(torch.randn(2, 8))
        inner_rope = get_rope(8, 8, 32, 10000.0)
        assert inner_rope is not rope  # the module shared before the block holds an uncounted kernel
        inner_rope(torch.arange(3), torch.randn(3, 16), torch.randn(3, 8))
    assert dict(calls) == {"rotary_embedding/torch": 1}
    assert kernels._resolve is resolve and get_rope(8, 8, 32, 10000.0) is not inner_rope


def test_a_cpu_model_on_a_cuda_machine_runs_the_cpu_kernels_and_backend(tiny_llama, monkeypatch):
    """On a CUDA machine (faked here), ``device="cpu"`` must select the torch ops and the torch
    attention backend, not Triton's CUDA kernels (which fail on CPU tensors), and must not share a
    rotary module with a model built for the GPU."""
    from framework import kernels, platform

    real = platform.detect_platform()
    cuda = platform.Platform(
        "cuda",
        num_devices=1,
        device_name="fake",
        compute_capability=(9, 0),
        packages=real.packages | {"triton"},
        probed=True,
    )
    monkeypatch.setattr(platform, "detect_platform", lambda probe_device=True: cuda)
    kernels._resolve.cache_clear()
    try:
        assert kernels.get_kernel("rms_norm").__module__ == "fw_triton_ops.norm"  # the fake machine's default
        with kernels.kernels_for("cuda:0"):
            gpu_rope = get_rope(8, 8, 32, 10000.0)
        with kernels.kernels_for("cuda:1"):  # a model on another GPU moves its own table
            assert get_rope(8, 8, 32, 10000.0) is not gpu_rope
        with kernels.kernels_for("cpu"):
            assert kernels.get_kernel("rms_norm") is ops.rms_norm
            assert get_rope(8, 8, 32, 10000.0) is not gpu_rope
        with count_kernel_calls() as calls:
            ids = generate_a_few_tokens(tiny_llama, device="cpu")
        monkeypatch.undo()
        kernels._resolve.cache_clear()
        assert ids == generate_a_few_tokens(tiny_llama, device="cpu")  # as on a machine without CUDA
        check_kernels_used(
            calls,
            {
                "rms_norm": "torch",
                "fused_add_rms_norm": "torch",
                "silu_and_mul": "torch",
                "rotary_embedding": "torch",
                "attention": "torch_sdpa",
            },
        )
    finally:
        kernels._resolve.cache_clear()
