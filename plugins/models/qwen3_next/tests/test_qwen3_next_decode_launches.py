"""A Qwen3.5-MoE decoder layer computes only through kernel-registry ops: every router softmax,
top-k, sigmoid gate, gated norm and DeltaNet gate is one op (one launch on a GPU, where the torch
chains they replace took two to seven launches each), a DeltaNet layer's four input projections
are one matmul, and no other torch op runs between them except views and the one copy named below.

Checked on the CPU on a tiny random Qwen3.5-MoE (dummy weights) through the engine: a dispatch
mode records the aten ops that run inside the decoder layers but outside the registry ops and
the attention layer, over a prefill and decode steps.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json

import pytest
import torch
from fw_qwen3_next.model import HybridDecoderLayer
from torch.utils._python_dispatch import TorchDispatchMode

from framework import LLM, SamplingParams, kernels
from framework.layers import rotary
from framework.layers.attention import Attention

TINY_QWEN3_5_MOE = {
    "architectures": ["Qwen3_5MoeForCausalLM"],
    "model_type": "qwen3_5_moe_text",
    "vocab_size": 160,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "partial_rotary_factor": 0.25,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 40,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}

#: Ops that launch nothing: allocations and metadata.
NO_LAUNCH = {"empty", "empty_strided", "detach", "lift_fresh", "alias"}
#: The one copy left: the query half of the attention projection made contiguous for the rotary
#: kernel (which reads rows of whole heads), once per attention layer and step.
KNOWN_COPIES = {"reshape": 1}

pytestmark = pytest.mark.usefixtures("one_thread")


class OpsOutsideKernels(TorchDispatchMode):
    """Counts the aten ops that run inside a decoder layer and outside every registry op / attention layer."""

    def __init__(self) -> None:
        super().__init__()
        self.in_layer = self.in_kernel = 0
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.in_layer and not self.in_kernel and not self.launches_nothing(func, args, out):
            self.ops[func.overloadpacket.__name__] += 1
        return out

    @staticmethod
    def launches_nothing(func, args, out) -> bool:
        """An allocation, or a view op whose result shares its input's storage (``reshape`` and
        ``to`` may copy: they count then)."""
        if func.overloadpacket.__name__ in NO_LAUNCH:
            return True
        if not func.is_view:
            return False
        if not isinstance(out, torch.Tensor) or not isinstance(args[0], torch.Tensor):
            return True
        return out.untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr()


@contextlib.contextmanager
def entered(mode: OpsOutsideKernels, attribute: str):
    setattr(mode, attribute, getattr(mode, attribute) + 1)
    try:
        yield
    finally:
        setattr(mode, attribute, getattr(mode, attribute) - 1)


def wrap(mode: OpsOutsideKernels, attribute: str, function):
    @functools.wraps(function)
    def wrapped(*args, **kwargs):
        with entered(mode, attribute):
            return function(*args, **kwargs)

    return wrapped


@pytest.fixture
def tiny_moe(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_QWEN3_5_MOE))
    return tmp_path


def test_decoder_layers_run_no_torch_op_between_registry_kernels(tiny_moe, monkeypatch):
    mode = OpsOutsideKernels()
    resolve = kernels._resolve
    registry_calls: collections.Counter[str] = collections.Counter()

    def resolving(op, name, generation, device_type):
        implementation = wrap(mode, "in_kernel", resolve(op, name, generation, device_type))

        def counted(*args, **kwargs):
            registry_calls[op] += 1
            return implementation(*args, **kwargs)

        return counted

    monkeypatch.setattr(kernels, "_resolve", resolving)
    monkeypatch.setattr(Attention, "forward", wrap(mode, "in_kernel", Attention.forward))
    monkeypatch.setattr(HybridDecoderLayer, "forward", wrap(mode, "in_layer", HybridDecoderLayer.forward))
    rotary._cached_rope.cache_clear()  # rotary modules built earlier hold unwrapped kernels
    try:
        llm = LLM(str(tiny_moe), load_format="dummy", num_blocks=16)
        steps = 3  # one prefill, two decodes
        with mode:
            result = llm.generate(
                {"prompt_token_ids": [3, 17, 9, 40, 11]},
                SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True),
            )
    finally:
        rotary._cached_rope.cache_clear()
    assert len(result[0].outputs[0].token_ids) == steps
    attention_layers, deltanet_layers, moe_layers = 1, 3, 4
    # nothing computes between the kernels but the one documented copy per attention layer and step
    assert dict(mode.ops) == {op: count * attention_layers * steps for op, count in KNOWN_COPIES.items()}
    # each layer's chains are single ops, once per layer and step
    per_step = {op: count // steps for op, count in registry_calls.items()}
    assert per_step["select_experts"] == per_step["fused_moe"] == moe_layers
    assert per_step["sigmoid_gate_mul"] == moe_layers + attention_layers  # shared experts, attention gates
    assert per_step["gdn_gating"] == per_step["rms_norm_gated"] == per_step["gated_delta_rule"] == deltanet_layers
    # matmuls: a DeltaNet layer's four input projections are one (GatedDeltaNet.init_buffers), out_proj;
    # attention qkv and o; per MoE the router, the shared expert's gate_up, down and gate; the LM head
    assert per_step["linear"] == 2 * deltanet_layers + 2 * attention_layers + 4 * moe_layers + 1
