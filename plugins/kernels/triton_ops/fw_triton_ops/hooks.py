"""Entry point of the ``triton_ops`` plugin: registration only, no torch or triton import here."""

from framework import hookimpl
from framework.specs import KernelSpec

#: op name -> (implementation, description); signatures and results are those of ``framework.ops``.
TRITON_KERNELS = {
    "rms_norm": ("fw_triton_ops.norm:rms_norm", "one program per row, float32 accumulation"),
    "fused_add_rms_norm": ("fw_triton_ops.norm:fused_add_rms_norm", "residual add and RMS norm in one kernel"),
    "silu_and_mul": ("fw_triton_ops.activation:silu_and_mul", "SwiGLU in one kernel"),
    "gelu_tanh_and_mul": ("fw_triton_ops.activation:gelu_tanh_and_mul", "GeGLU (tanh) in one kernel"),
    "rotary_embedding": ("fw_triton_ops.rotary:rotary_embedding", "query and key in one kernel; neox/GPT-J, partial"),
    "qk_norm_rotary_embedding": (
        "fw_triton_ops.rotary:qk_norm_rotary_embedding",
        "per-head RMS norm of query and key, then rotary, in one kernel",
    ),
    "fused_moe": ("fw_triton_ops.fused_moe:fused_moe", "MoE experts as two grouped GEMMs (SiLU-and-mul fused)"),
    "moe_align_block_size": (
        "fw_triton_ops.fused_moe:align_pairs_to_blocks",
        "MoE pairs sorted into blocks of one expert: one program for a decode batch, a device sort beyond",
    ),
    "linear": (
        "fw_triton_ops.gemv:linear",
        "split-K GEMV for one row (bf16/fp16, Hopper+, at the shapes measured faster than cuBLAS); F.linear otherwise",
    ),
    "gated_delta_rule": (
        "fw_triton_ops.gated_delta_net:gated_delta_rule",
        "decodes: one program per (sequence, value head, v block), the state in registers; "
        "prefill: chunks of 64 in the WY form",
    ),
    "causal_conv1d": (
        "fw_triton_ops.gated_delta_net:causal_conv1d",
        "decodes shift their state in one program; prefill chunks by token blocks, then their new states",
    ),
    "select_experts": (
        "fw_triton_ops.routing:select_experts",
        "MoE router: softmax or sigmoid scores, top-k, renormalised, in one program per token",
    ),
    "gdn_gating": ("fw_triton_ops.gates:gdn_gating", "a GDN layer's g and beta from a and b in one launch"),
    "sigmoid_gate_mul": (
        "fw_triton_ops.gates:sigmoid_gate_mul",
        "x * sigmoid(gate) (+ residual) in one launch, the gate read through its strides",
    ),
    "rms_norm_gated": ("fw_triton_ops.norm:rms_norm_gated", "RMS norm times silu(gate), one program per row"),
}

#: Implementations not yet measured inside a model: ranked below the torch reference (priority 0),
#: so they run only when forced (``FW_KERNELS="op=triton"``) until a GPU run shows them ahead. Empty
#: now: the DeltaNet, router and gate kernels became defaults once Qwen3.5-35B-A3B measured them inside
#: the model (batch 1: 249.8 tok/s, against 168.7 with only the two DeltaNet kernels; docs/benchmarks.md).
OPT_IN_KERNELS: dict[str, tuple[str, str]] = {}


@hookimpl
def register_kernels():
    return [
        KernelSpec(
            op=op,
            name="triton",
            impl=impl,
            description=description,
            priority=priority,
            devices=("cuda",),
            requires=("triton",),
        )
        for kernels, priority in ((TRITON_KERNELS, 10), (OPT_IN_KERNELS, -10))
        for op, (impl, description) in kernels.items()
    ]
