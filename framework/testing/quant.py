"""Conformance kits for quantization methods: every layer kind against dequantize-then-matmul.

A plugin author describes the format with a :class:`QuantScheme` (how to make a random quantized
checkpoint tensor and the values it stands for, decoded by a reference independent of the method
under test, and which ``QuantConfig`` reads such a checkpoint) and calls::

    check_linear_method(scheme)              # Replicated/Column/Row/MergedColumn/QKV linear layers
    check_moe_method(scheme)                 # FusedMoE

Each builds the layer twice, quantized and unquantized (the second loaded with the reference
values, so the core's own tensor-parallel slicing is the oracle), for every rank of every
tensor-parallel size (``tp_size`` / ``tp_rank`` given explicitly, no process group), loads the
checkpoint through the real loader (``model_loader.load_weights`` and ``finish_loading``) and
compares, in each activation dtype and for each number of rows: the method's ``apply`` with
the float32 matmul of the reference weights (relative to the output's largest value), and its
``dequantize`` with the reference weights rounded to the dtype (within that dtype's
tolerance). On a CUDA device the ``apply`` is also captured in a CUDA graph and replayed on
fresh inputs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from framework.loader.model_loader import default_dtype

#: Checkpoint projection -> fused layer, as the model classes declare them.
PACKED_MODULES = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}

#: Largest ``max |out - reference| / max |reference|`` per activation dtype.
RELATIVE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


class QuantScheme(Protocol):
    """A quantization format, as the conformance kits need it.

    ``block_size``: input features are multiples of it (and stay so when split over 4 ranks).
    """

    block_size: int

    def make_weight(
        self, name: str, shape: tuple[int, ...], generator: torch.Generator
    ) -> tuple[dict[str, Tensor], Tensor]:
        """Random quantized checkpoint tensors for the float weight ``name`` (``"x.q_proj.weight"``)
        of ``shape`` (``[out, in]``, or ``[E, out, in]`` for an expert stack), on the CPU, and the
        float32 values they stand for (decoded independently of the method under test)."""

    def quant_config(self, tensors: dict[str, Tensor]) -> Any:
        """The ``QuantConfig`` of a checkpoint holding ``tensors`` (every name :meth:`make_weight` made)."""


class _Holder(nn.Module):
    """A model of one layer at ``layer.<name>``, as ``model_loader`` expects one."""

    packed_modules_mapping = PACKED_MODULES

    def __init__(self, name: str, layer: nn.Module, map_weight_name: Callable | None = None) -> None:
        super().__init__()
        self.layer = nn.Module()
        self.layer.add_module(name, layer)
        if map_weight_name is not None:
            self.map_weight_name = map_weight_name


def _build(
    name: str,
    make: Callable[[Any, str], nn.Module],
    quant_config: Any,
    tensors: dict[str, Tensor],
    device: str,
    map_weight_name: Callable | None = None,
) -> nn.Module:
    """``make(quant_config, prefix)`` on ``device``, loaded with ``tensors`` through the real loader."""
    from framework.kernels import kernels_for
    from framework.loader import model_loader

    if quant_config is not None:
        quant_config.packed_modules_mapping = dict(PACKED_MODULES)
    with torch.device(device), kernels_for(device):
        layer = make(quant_config, f"layer.{name}")
    holder = _Holder(name, layer, map_weight_name)
    loaded = model_loader.load_weights(holder, ((key, value.to(device)) for key, value in tensors.items()))
    model_loader.check_all_loaded(holder, loaded, f"conformance checkpoint for layer.{name}")
    model_loader.finish_loading(holder, torch.device(device))
    return layer


def _checkpoint(
    scheme: QuantScheme, shapes: dict[str, tuple[int, ...]], seed: int
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """``(quantized checkpoint, reference float32 checkpoint)`` for weights ``shapes``."""
    generator = torch.Generator().manual_seed(seed)
    quantized, dense = {}, {}
    for name, shape in shapes.items():
        tensors, values = scheme.make_weight(name, shape, generator)
        if tuple(values.shape) != tuple(shape):
            raise AssertionError(
                f"{type(scheme).__name__}.make_weight({name!r}) gave values {tuple(values.shape)}, not {shape}"
            )
        quantized.update(tensors)
        dense[name] = values.float()
    return quantized, dense


def _check_close(what: str, out: Tensor, reference: Tensor, dtype: torch.dtype, rounding: Tensor | None = None) -> None:
    """``out`` within the dtype's tolerance of the largest reference output, plus ``rounding`` (per
    output: what a declared rounding of the activations can change, :func:`activation_rounding_bound`).
    A reference beyond ``dtype``'s finite range is the scheme's test data's fault, said so."""
    scale = reference.abs().max().clamp_min(1e-12)
    if scale.item() > torch.finfo(dtype).max:
        raise AssertionError(
            f"{what}: the float32 reference reaches {scale.item():.3g}, beyond {dtype}'s largest value "
            f"{torch.finfo(dtype).max:g}: the scheme's weights are too large for this dtype"
        )
    excess = (out.float() - reference).abs() - (0 if rounding is None else rounding)
    error = (excess.max() / scale).item()
    if not error <= RELATIVE_TOLERANCE[dtype]:
        raise AssertionError(
            f"{what}: max error {error:.3g} of the largest output (allowed "
            f"{RELATIVE_TOLERANCE[dtype]:g} in {dtype}"
            f"{'' if rounding is None else ' beyond the declared activation rounding'})"
        )


def activation_rounding_bound(x: Tensor, weight: Tensor, group: int) -> Tensor:
    """The most that rounding ``x`` ``[rows, K]`` to int8 per ``group`` features (half a step,
    ``max |x| / 254`` of the group, each) can change ``x @ weight.T``: ``sum_k |W[n, k]| * step_k / 2``."""
    rows, k = x.shape
    half_steps = x.float().reshape(rows, k // group, group).abs().amax(-1) / 254.0
    return (half_steps.repeat_interleave(group, dim=1) * (1 + 1e-3)) @ weight.float().abs().T


def _check_graph_replay(
    what: str, run: Callable[[Tensor], Tensor], example: Tensor, generator: torch.Generator
) -> None:
    """``run`` captured in a CUDA graph gives, replayed on new inputs, what it gives eagerly."""
    static = example.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run(static)  # warm-up outside the capture (lazy initialisation, autotuning)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run(static)
    for _ in range(2):
        fresh = torch.randn(example.shape, generator=generator).to(example)
        static.copy_(fresh)
        graph.replay()
        # the captured path may differ from the eager one (a packed MoE method dequantizes every
        # expert inside a capture, loops over the experts hit outside it), so both are held to the
        # dtype's tolerance of the largest output, as against the reference
        _check_close(f"{what} in a CUDA graph", captured, run(fresh).float(), example.dtype)


def _linear_layers(hidden: int) -> dict[str, tuple[dict[str, tuple[int, int]], Callable]]:
    """Layer name -> (its checkpoint weights' shapes, ``make(tp_size, tp_rank)`` -> ``make(quant_config, prefix)``)."""
    from framework.layers import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )

    head, heads, kv_heads, inter = 32, 4, 2, 128
    return {
        "proj": (
            {"layer.proj.weight": (96, hidden)},
            lambda tp, rank: (
                lambda qc, p: ReplicatedLinear(hidden, 96, quant_config=qc, prefix=p, tp_size=tp, tp_rank=rank)
            ),
        ),
        "up": (
            {"layer.up.weight": (128, hidden)},
            lambda tp, rank: (
                lambda qc, p: ColumnParallelLinear(hidden, 128, quant_config=qc, prefix=p, tp_size=tp, tp_rank=rank)
            ),
        ),
        "down_proj": (
            {"layer.down_proj.weight": (96, 4 * hidden)},
            lambda tp, rank: (
                lambda qc, p: RowParallelLinear(
                    4 * hidden, 96, quant_config=qc, prefix=p, tp_size=tp, tp_rank=rank, reduce_results=False
                )
            ),
        ),
        "gate_up_proj": (
            {"layer.gate_proj.weight": (inter, hidden), "layer.up_proj.weight": (inter, hidden)},
            lambda tp, rank: (
                lambda qc, p: MergedColumnParallelLinear(
                    hidden, [inter, inter], quant_config=qc, prefix=p, tp_size=tp, tp_rank=rank
                )
            ),
        ),
        "qkv_proj": (
            {
                "layer.q_proj.weight": (heads * head, hidden),
                "layer.k_proj.weight": (kv_heads * head, hidden),
                "layer.v_proj.weight": (kv_heads * head, hidden),
            },
            lambda tp, rank: (
                lambda qc, p: QKVParallelLinear(
                    hidden, head, heads, kv_heads, quant_config=qc, prefix=p, tp_size=tp, tp_rank=rank
                )
            ),
        ),
    }


def check_linear_method(
    scheme: QuantScheme,
    *,
    device: str = "cpu",
    dtypes: Iterable[torch.dtype] = (torch.bfloat16, torch.float16),
    num_rows: Iterable[int] = (1, 7, 64, 512),
    tp_sizes: Iterable[int] = (1, 2, 4),
    cuda_graph: bool | None = None,
    seed: int = 0,
) -> list[str]:
    """Check ``scheme``'s LinearMethod on every linear layer kind (see the module docstring).

    Input features are ``block_size`` (``4 * block_size`` for the row-parallel layer, so each of 4
    ranks keeps whole blocks); ``cuda_graph`` defaults to ``device`` being CUDA. Returns the
    cases checked (``"qkv_proj tp=2 rank=1 bfloat16"``); raises ``AssertionError`` naming the first
    that fails.
    """
    import torch.nn.functional as F

    dtypes, num_rows = list(dtypes), list(num_rows)
    cuda_graph = torch.device(device).type == "cuda" if cuda_graph is None else cuda_graph
    generator = torch.Generator().manual_seed(seed + 1)
    checked = []
    for index, (name, (shapes, factory)) in enumerate(_linear_layers(scheme.block_size).items()):
        quantized, dense = _checkpoint(scheme, shapes, seed + index)
        for tp_size, dtype in itertools.product(tp_sizes, dtypes):
            for rank in range(tp_size):
                make = factory(tp_size, rank)
                case = f"{name} tp={tp_size} rank={rank} {str(dtype).removeprefix('torch.')}"
                with default_dtype(dtype):  # params_dtype, as the engine's loader builds layers
                    layer = _build(name, make, scheme.quant_config(quantized), quantized, device)
                reference = _build(name, make, None, dense, device)  # float32
                method = layer.linear_method
                torch.testing.assert_close(
                    method.dequantize(layer).to(dtype),
                    reference.weight.to(dtype),
                    msg=lambda m, case=case: f"{case}: dequantize(): {m}",
                )
                for rows in num_rows:
                    x = torch.randn(rows, layer.input_size_per_partition, generator=generator).to(device, dtype)
                    out = method.apply(layer, x)
                    group = method.activation_group(layer, x)
                    rounding = None if group is None else activation_rounding_bound(x, reference.weight, group)
                    _check_close(
                        f"{case} rows={rows}", out, F.linear(x.float(), reference.weight.float()), dtype, rounding
                    )
                if cuda_graph:
                    example = torch.randn(num_rows[0], layer.input_size_per_partition, generator=generator).to(
                        device, dtype
                    )
                    _check_graph_replay(case, lambda x, m=method, lay=layer: m.apply(lay, x), example, generator)
                checked.append(case)
    return checked


def check_moe_method(
    scheme: QuantScheme,
    *,
    device: str = "cpu",
    dtypes: Iterable[torch.dtype] = (torch.bfloat16, torch.float16),
    num_tokens: Iterable[int] = (1, 7, 64, 512),
    tp_sizes: Iterable[int] = (1, 2, 4),
    num_experts: int = 16,
    top_k: int = 2,
    cuda_graph: bool | None = None,
    seed: int = 0,
) -> list[str]:
    """Check ``scheme``'s FusedMoEMethod on a FusedMoE of ``num_experts`` SwiGLU experts (hidden size
    ``block_size``, intermediate ``4 * block_size``), checkpoint stacks ``layer.experts.{gate,up,down}_proj``,
    routed by random router logits: ``apply`` against the torch ``fused_moe`` in float32 on the
    reference weights, ``dequantize`` against them. Few tokens (``T * top_k <= num_experts``) and
    many take different paths in most methods; the defaults cover both. Returns the cases checked.
    """
    from framework import ops
    from framework.layers.fused_moe import FusedMoE, map_expert_weight_name, select_experts

    dtypes, num_tokens = list(dtypes), list(num_tokens)
    cuda_graph = torch.device(device).type == "cuda" if cuda_graph is None else cuda_graph
    hidden, inter = scheme.block_size, 4 * scheme.block_size
    shapes = {
        "layer.experts.gate_proj.weight": (num_experts, inter, hidden),
        "layer.experts.up_proj.weight": (num_experts, inter, hidden),
        "layer.experts.down_proj.weight": (num_experts, hidden, inter),
    }
    quantized, dense = _checkpoint(scheme, shapes, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    checked = []
    for tp_size, dtype in itertools.product(tp_sizes, dtypes):
        for rank in range(tp_size):

            def make(qc, prefix, tp=tp_size, r=rank):
                return FusedMoE(
                    num_experts,
                    top_k,
                    hidden,
                    inter,
                    renormalize=True,
                    quant_config=qc,
                    prefix=prefix,
                    tp_size=tp,
                    tp_rank=r,
                    reduce_results=False,
                )

            case = f"experts tp={tp_size} rank={rank} {str(dtype).removeprefix('torch.')}"
            with default_dtype(dtype):
                layer = _build(
                    "experts", make, scheme.quant_config(quantized), quantized, device, map_expert_weight_name
                )
            reference = _build("experts", make, None, dense, device, map_expert_weight_name)  # float32
            method = layer.quant_method
            for got, want, what in zip(
                method.dequantize(layer), (reference.w13_weight, reference.w2_weight), ("w13", "w2")
            ):
                torch.testing.assert_close(
                    got.to(dtype),
                    want.to(dtype),
                    msg=lambda m, case=case, what=what: f"{case}: dequantize() {what}: {m}",
                )

            def run(x: Tensor, logits: Tensor, m=method, lay=layer) -> Tensor:
                topk_weights, topk_ids = select_experts(logits, top_k, renormalize=True)
                return m.apply(lay, x, topk_weights, topk_ids)

            for tokens in num_tokens:
                x = torch.randn(tokens, hidden, generator=generator).to(device, dtype)
                logits = torch.randn(tokens, num_experts, generator=generator).to(device)
                topk_weights, topk_ids = select_experts(logits, top_k, renormalize=True)
                want = ops.fused_moe(
                    x.float(), reference.w13_weight.float(), reference.w2_weight.float(), topk_weights, topk_ids
                )
                _check_close(f"{case} tokens={tokens}", run(x, logits), want, dtype)
            if cuda_graph:
                for tokens in (num_tokens[0], num_tokens[-1]):
                    logits = torch.randn(tokens, num_experts, generator=generator).to(device)
                    example = torch.randn(tokens, hidden, generator=generator).to(device, dtype)
                    _check_graph_replay(f"{case} tokens={tokens}", lambda x, lg=logits: run(x, lg), example, generator)
            checked.append(case)
    return checked
