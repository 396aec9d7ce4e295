"""Mixture-of-experts: the routing function and :class:`FusedMoE`, the experts of one layer.

The experts of a layer are stacked into two tensors, so one kernel launch serves them all::

    w13_weight  [E, 2 * I, H]   expert e's gate rows [0, I) then its up rows [I, 2I)  (gate_proj | up_proj)
    w2_weight   [E, H, I]       expert e's down projection                           (down_proj)

``forward(hidden, router_logits)`` routes each token to ``top_k`` experts with a routing function
(the kernel registry's ``select_experts`` op, :func:`framework.ops_fused.select_experts`: softmax
then top-k, optionally renormalised, in one launch on GPUs; others such as DeepSeek's grouped
top-k plug in by passing their own ``topk_weights, topk_ids``) and
runs the kernel registry's ``fused_moe`` op (the torch reference in ``framework.ops`` on CPU, a
Triton grouped GEMM on GPUs). The router itself (a ``ReplicatedLinear``) and any shared expert
belong to the model's MoE block.

Tensor parallelism (``tp_size`` ranks; the vLLM layout): every rank holds *all* experts, each
with ``I / tp`` of its intermediate features: rank r keeps gate and up rows ``[r*I/tp, (r+1)*I/tp)``
of every expert (column-parallel per expert) and the same columns of its down projection
(row-parallel per expert), so its kernel output is a partial sum over the intermediate features.
The layer all-reduces it (``reduce_results=True``), or leaves the sum to a caller that adds
another partial output first (a shared expert) and reduces once. Routing is computed on every
rank from the replicated router, so the ranks agree on the experts.

Checkpoints name experts in several ways; :func:`expert_weight_target` maps them all onto the
stacked parameters (:func:`map_expert_weight_name` is the ``map_weight_name`` of a MoE model), and :meth:`FusedMoE.weight_loader` copies them in:

| checkpoint | names (under ``...experts.``) | loaded as |
| --- | --- | --- |
| Qwen2/3-MoE, DeepSeek | ``{e}.gate_proj`` / ``{e}.up_proj`` / ``{e}.down_proj`` ``.weight`` | one expert's w1 / w3 / w2 |
| Mixtral | ``{e}.w1`` / ``{e}.w3`` / ``{e}.w2`` ``.weight`` | the same |
| transformers 5 state dict | ``gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]`` | all experts at once |
| GGUF (stacked per projection) | ``gate_proj.weight`` ``[E, I, H]``, ``up_proj``, ``down_proj`` | all experts, one shard |

A name's last part picks the parameter (``.weight`` -> ``w13_weight``; a quantized method's
``.qweight`` / ``.scales`` / ``.weight_scale`` -> ``w13_qweight`` / ...), created by the layer's
quant method (:class:`~framework.quantization.FusedMoEMethod`).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from framework.errors import ConfigError
from framework.kernels import get_kernel
from framework.layers.linear import (
    KeepsWeightAttrs,
    copy_weight,
    resolve_tp,
    set_weight_attrs,
    tensor_parallel_all_reduce,
)
from framework.loader.checkpoint_slice import materialize
from framework.ops import MoEActivation
from framework.ops_fused import RoutedExperts, select_experts  # noqa: F401  (re-exported)
from framework.quantization import FusedMoEMethod, quant_method_for

if TYPE_CHECKING:
    from framework.quantization import QuantConfig

#: Checkpoint projection name -> the shard of the stacked weights it fills.
EXPERT_SHARDS = {"gate_proj": "w1", "w1": "w1", "up_proj": "w3", "w3": "w3", "down_proj": "w2", "w2": "w2"}

# the tensor's suffix (weight, qweight, scales, weight_scale, ...) names the parameter: w13_<suffix>, w2_<suffix>
_PER_EXPERT = re.compile(
    r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)"
    r"\.(?P<suffix>\w+)$"
)
_STACKED = re.compile(
    r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj|gate_proj|up_proj)(?:\.(?P<suffix>\w+))?$"
)


def expert_weight_target(name: str) -> tuple[str, tuple[str, int | None]] | None:
    """``(parameter name, (shard_id, expert_id))`` for a checkpoint name of an expert tensor, else None.

    ``shard_id`` is ``"w1"`` (gate), ``"w3"`` (up), ``"w13"`` (gate and up concatenated) or
    ``"w2"`` (down); ``expert_id`` is None when the tensor holds every expert, stacked on dim 0.
    The parameter is ``w13_<suffix>`` or ``w2_<suffix>`` after the checkpoint name's last part
    (``.weight`` -> ``w13_weight``, ``.qweight`` -> ``w13_qweight``, ``.weight_scale`` ->
    ``w13_weight_scale``; a stacked tensor without a suffix is a ``weight``), so a quantized
    method's parameters receive their tensors by name.
    """
    if match := _PER_EXPERT.match(name):
        shard, expert = EXPERT_SHARDS[match["proj"]], int(match["expert"])
    elif match := _STACKED.match(name):
        shard = {"gate_up_proj": "w13", "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[match["proj"]]
        expert = None
    else:
        return None
    param = "w2" if shard == "w2" else "w13"
    return f"{match['prefix']}.{param}_{match['suffix'] or 'weight'}", (shard, expert)


def map_expert_weight_name(name: str) -> tuple[str, tuple | None]:
    """A MoE model's ``map_weight_name`` (see ``framework.loader.model_loader.load_weights``):
    expert tensors go to the stacked :class:`FusedMoE` weights with their ``(shard_id,
    expert_id)``; any other name comes back unchanged with None, to fold through
    ``packed_modules_mapping``."""
    target = expert_weight_target(name)
    return target if target is not None else (name, None)


def create_expert_biases(
    layer: nn.Module, num_experts: int, hidden_size: int, width: int, params_dtype: torch.dtype
) -> None:
    """``w13_bias [E, 2 * width]`` (gate then up) and ``w2_bias [E, H]`` on a layer built with
    ``bias=True`` (gpt-oss), for any quant method (biases stay in ``params_dtype``)."""
    if not layer.has_bias:
        return
    w13 = nn.Parameter(torch.empty(num_experts, 2 * width, dtype=params_dtype), requires_grad=False)
    w2 = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=params_dtype), requires_grad=False)
    set_weight_attrs(w13, {"weight_loader": layer.weight_loader, "moe_projection": "w13", "feature_dim": -1})
    set_weight_attrs(w2, {"weight_loader": layer.weight_loader, "moe_projection": "w2", "feature_dim": None})
    layer.register_parameter("w13_bias", w13)
    layer.register_parameter("w2_bias", w2)


class UnquantizedFusedMoEMethod(FusedMoEMethod):
    """Plain ``w13_weight [E, 2I, H]`` / ``w2_weight [E, H, I]`` in ``params_dtype``, run by the kernel
    registry's ``fused_moe`` op, resolved once in :meth:`create_weights` (as ``UnquantizedLinearMethod``)."""

    supports_moe_activation = True

    def create_weights(
        self,
        layer: nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
    ) -> None:
        width = intermediate_size_per_partition
        w13 = nn.Parameter(torch.empty(num_experts, 2 * width, hidden_size, dtype=params_dtype), requires_grad=False)
        w2 = nn.Parameter(torch.empty(num_experts, hidden_size, width, dtype=params_dtype), requires_grad=False)
        set_weight_attrs(w13, {"weight_loader": layer.weight_loader, "moe_projection": "w13", "feature_dim": -2})
        set_weight_attrs(w2, {"weight_loader": layer.weight_loader, "moe_projection": "w2", "feature_dim": -1})
        layer.register_parameter("w13_weight", w13)
        layer.register_parameter("w2_weight", w2)
        create_expert_biases(layer, num_experts, hidden_size, width, params_dtype)
        self.fused_moe = get_kernel("fused_moe")

    def apply(self, layer: nn.Module, hidden: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        if layer.is_plain_swiglu:
            return self.fused_moe(hidden, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids)
        return self.fused_moe(hidden, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, layer.activation())

    def dequantize(self, layer: nn.Module) -> tuple[Tensor, Tensor]:
        return layer.w13_weight, layer.w2_weight


class FusedMoE(KeepsWeightAttrs):
    """``num_experts`` SwiGLU experts of one layer, stacked; each token uses ``top_k`` of them.

    ``forward(hidden [T, H], router_logits [T, E])`` routes with :func:`select_experts`
    (``renormalize`` as the model says); ``forward(hidden, topk_weights=..., topk_ids=...)``
    takes a routing computed elsewhere (grouped top-k, sigmoid scores, bias-corrected routers).
    Returns ``[T, H]``: the routing-weighted sum of the chosen experts' outputs.

    Storage and compute belong to the layer's :class:`~framework.quantization.FusedMoEMethod`
    (``quant_method``): ``quant_config.get_quant_method(self, prefix)``, else
    :class:`UnquantizedFusedMoEMethod` (plain weights in ``params_dtype``; GGUF experts on the CPU
    load there, dequantized lazily: only this rank's features, in ``params_dtype``).

    :meth:`weight_loader` serves any method's expert parameters that carry these attributes:

    * ``moe_projection``: ``"w13"`` (gate then up) or ``"w2"`` (down);
    * ``feature_dim``: the (negative) dimension along which the expert's intermediate features
      run, ``-2`` for ``w13_weight [E, 2I, H]``, ``-1`` for ``w2_weight [E, H, I]``; a packed
      parameter may hold several features per entry or several entries per feature (offsets
      scale with ``size(feature_dim) / features``); ``None``: not split (a per-expert scale);
    * ``per_shard=True`` (``w13`` only, with ``feature_dim`` None): the last dimension has two
      entries, gate then up, each filled from its own checkpoint tensor.

    Tensor parallelism: ``tp_size`` / ``tp_rank`` default to this process's group; this rank
    holds ``intermediate_size_per_partition = intermediate_size / tp_size`` features of every
    expert (a width that does not divide is refused with :class:`ConfigError`).
    ``reduce_results=False`` returns this rank's partial sum for the caller to all-reduce.

    gpt-oss: ``bias=True`` adds ``w13_bias [E, 2I]`` / ``w2_bias [E, H]`` (:func:`create_expert_biases`,
    which a quant method calls from its ``create_weights``), and ``swiglu_limit`` swaps SiLU-and-mul
    for the clamped SwiGLU (:func:`framework.ops.swiglu_oai_and_mul`); ``activation="gelu_tanh"``
    makes the experts GeGLU (Gemma 4). Methods pass :meth:`activation` to their kernel when
    :attr:`is_plain_swiglu` is False.
    """

    #: Its loaders only narrow and copy, so they take lazy checkpoint slices (model_loader).
    reads_checkpoint_slices = True

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        renormalize: bool,
        quant_config: QuantConfig | None = None,
        prefix: str = "",
        params_dtype: torch.dtype | None = None,
        tp_size: int | None = None,
        tp_rank: int | None = None,
        reduce_results: bool = True,
        bias: bool = False,
        swiglu_limit: float | None = None,
        swiglu_alpha: float = 1.702,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        if activation not in ("silu", "gelu_tanh") or (activation == "gelu_tanh" and (bias or swiglu_limit)):
            raise ValueError(
                f"{prefix}: expert activation {activation!r} (bias={bias}, swiglu_limit={swiglu_limit}); valid: "
                "'silu' (optionally with biases and a clamp), 'gelu_tanh' (neither)"
            )
        self.activation_name = activation
        if not 0 < top_k <= num_experts:
            raise ValueError(f"{prefix}: top_k must be in 1..num_experts ({num_experts}), got {top_k}")
        tp_size, tp_rank = resolve_tp(tp_size, tp_rank)
        if intermediate_size % tp_size:
            raise ConfigError(
                f"{prefix}: the experts' intermediate size {intermediate_size} (moe_intermediate_size; "
                f"Mixtral: intermediate_size) cannot be split over {tp_size} tensor-parallel ranks; use a "
                f"tensor-parallel size that divides {intermediate_size}"
            )
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size, self.prefix = hidden_size, intermediate_size, prefix
        self.tp_size, self.tp_rank, self.reduce_results = tp_size, tp_rank, reduce_results
        self.intermediate_size_per_partition = width = intermediate_size // tp_size
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.has_bias, self.swiglu_limit, self.swiglu_alpha = bias, swiglu_limit, swiglu_alpha
        method = quant_method_for(quant_config, self, prefix, FusedMoEMethod, "a FusedMoE layer")
        self.quant_method: FusedMoEMethod = method or UnquantizedFusedMoEMethod()
        if not self.is_plain_swiglu and not self.quant_method.supports_moe_activation:
            raise ConfigError(
                f"{prefix}: {type(self.quant_method).__name__} cannot run experts with biases, the clamped "
                "SwiGLU (gpt-oss) or GeGLU (Gemma 4); use an unquantized or MXFP4 checkpoint"
            )
        self.quant_method.create_weights(self, num_experts, hidden_size, width, self.params_dtype)
        self._select_experts = get_kernel("select_experts")
        self._loaded_experts: dict[str, set[int]] = {"w1": set(), "w3": set(), "w2": set()}
        #: (parameter id, expert) of gate/up values loaded into a parameter they share (not per_shard)
        self._shared_loaded: set[tuple[int, int | None]] = set()

    def weight_loader(self, param: Tensor, loaded_weight: Tensor, shard_id: str, expert_id: int | None = None) -> None:
        """Copy this rank's part of a full checkpoint tensor into ``param`` (a ``w13_*`` or ``w2_*`` parameter).

        ``shard_id``: ``"w1"`` (gate rows of w13), ``"w3"`` (up rows), ``"w13"`` (both, gate
        then up) or ``"w2"``; ``expert_id``: the expert, or None for a tensor stacking all
        experts on dim 0. ``loaded_weight`` may be a lazy ``CheckpointSlice``: only this rank's
        intermediate features (along the parameter's ``feature_dim``) are read.
        """
        self.check_expert_shard(param, shard_id, expert_id)
        target = param.data if expert_id is None else param.data[expert_id]
        dim = getattr(param, "feature_dim", None)
        if dim is None:
            self._load_unsplit(param, target, loaded_weight, shard_id, expert_id)
        else:
            features = self.intermediate_size_per_partition * (1 if shard_id == "w2" else 2)
            if param.size(dim) * self.intermediate_size_per_partition % features:
                raise ValueError(
                    f"{self.prefix}: a parameter with {param.size(dim)} entries along its feature_dim "
                    f"cannot hold whole entries for {self.intermediate_size_per_partition} features per shard"
                )
            entries = lambda n: n * param.size(dim) // features  # noqa: E731  (entries of n features)
            size, width = entries(self.intermediate_size), entries(self.intermediate_size_per_partition)
            start = self.tp_rank * width
            if shard_id == "w2":
                copy_weight(target, self._narrow(loaded_weight, dim, size, start, width))
            elif shard_id == "w13":  # [.., 2I, H]: gate rows [0, I), up rows [I, 2I)
                copy_weight(target.narrow(dim, 0, width), self._narrow(loaded_weight, dim, 2 * size, start, width))
                copy_weight(
                    target.narrow(dim, width, width), self._narrow(loaded_weight, dim, 2 * size, size + start, width)
                )
            else:
                copy_weight(
                    target.narrow(dim, 0 if shard_id == "w1" else width, width),
                    self._narrow(loaded_weight, dim, size, start, width),
                )
        self.record_loaded(shard_id, expert_id)

    def check_expert_shard(self, param: Tensor, shard_id: str, expert_id: int | None) -> None:
        """Refuse an unknown ``shard_id``, a shard in the wrong projection's parameter or an expert out of range."""
        if shard_id not in ("w1", "w3", "w13", "w2"):
            raise ValueError(
                f"{self.prefix}: unknown expert shard {shard_id!r}; valid: w1 (gate), w3 (up), w13, w2 (down)"
            )
        if (shard_id == "w2") != (getattr(param, "moe_projection", None) == "w2"):
            raise ValueError(f"{self.prefix}: expert shard {shard_id!r} does not belong in this parameter")
        if expert_id is not None and not 0 <= expert_id < self.num_experts:
            raise ValueError(
                f"{self.prefix}: expert {expert_id} out of range; this layer has {self.num_experts} experts"
            )

    def record_loaded(self, shard_id: str, expert_id: int | None) -> None:
        """Note that ``shard_id`` of ``expert_id`` (None: every expert) is loaded (for :meth:`missing_weights`);
        a method with its own loader calls this."""
        experts = range(self.num_experts) if expert_id is None else (expert_id,)
        for shard in ("w1", "w3") if shard_id == "w13" else (shard_id,):
            self._loaded_experts[shard].update(experts)

    def _load_unsplit(
        self, param: Tensor, target: Tensor, loaded_weight: Tensor, shard_id: str, expert_id: int | None
    ) -> None:
        """A parameter not split by features: whole, or (``per_shard``) its gate or up entry. Gate and
        up loaded into one shared entry must agree (as for fused linear layers: the last would win)."""
        loaded_weight = materialize(loaded_weight)
        shared = shard_id in ("w1", "w3") and not getattr(param, "per_shard", False)
        if shard_id in ("w1", "w3") and not shared:
            target = target[..., 0 if shard_id == "w1" else 1]
        if loaded_weight.numel() == target.numel():
            loaded_weight = loaded_weight.reshape(target.shape)
        key = (id(param), expert_id)
        if shared and key in self._shared_loaded and not torch.equal(target, loaded_weight.to(target)):
            raise ValueError(
                f"{self.prefix}: the {'up' if shard_id == 'w3' else 'gate'} projection holds a different "
                f"value for a parameter of shape {tuple(param.shape)} that gate and up share (it has neither "
                "feature_dim nor per_shard=True); a quantity kept per projection needs per_shard=True"
            )
        copy_weight(target, loaded_weight)
        if shared:
            self._shared_loaded.add(key)

    def _narrow(self, loaded_weight: Tensor, dim: int, full: int, start: int, width: int) -> Tensor:
        """``loaded_weight.narrow(dim, start, width)``, refusing a tensor whose ``dim`` is not ``full`` long."""
        if loaded_weight.dim() < 2 or loaded_weight.size(dim) != full:
            raise ValueError(
                f"{self.prefix}: checkpoint tensor of shape {tuple(loaded_weight.shape)} does not fit: "
                f"expected {full} entries along dim {dim} (experts' intermediate size "
                f"{self.intermediate_size})"
            )
        return loaded_weight.narrow(dim % loaded_weight.dim(), start, width)

    def missing_weights(self) -> list[str]:
        """The expert shards no checkpoint tensor has filled (``check_all_loaded`` reports them)."""
        names = {"w1": "gate (w13_weight)", "w3": "up (w13_weight)", "w2": "down (w2_weight)"}
        missing = []
        for shard, loaded in self._loaded_experts.items():
            absent = sorted(set(range(self.num_experts)) - loaded)
            if absent:
                shown = ", ".join(map(str, absent[:8])) + (f" and {len(absent) - 8} more" if len(absent) > 8 else "")
                missing.append(f"{names[shard]} of expert(s) {shown}")
        return missing

    @property
    def is_plain_swiglu(self) -> bool:
        """No biases and SiLU-and-mul: every ``fused_moe`` kernel serves it."""
        return not self.has_bias and self.swiglu_limit is None and self.activation_name == "silu"

    def activation(self) -> MoEActivation:
        """The biases and activation for ``fused_moe``; the down bias on rank 0 only (the ranks'
        partial sums are added up)."""
        return MoEActivation(
            getattr(self, "w13_bias", None),
            getattr(self, "w2_bias", None) if self.tp_rank == 0 else None,
            self.swiglu_limit,
            self.swiglu_alpha,
            self.activation_name == "gelu_tanh",
        )

    def forward(
        self,
        hidden: Tensor,
        router_logits: Tensor | None = None,
        *,
        topk_weights: Tensor | None = None,
        topk_ids: Tensor | None = None,
    ) -> Tensor:
        if topk_ids is None:
            if router_logits is None:
                raise ValueError("FusedMoE.forward needs router_logits or precomputed topk_weights and topk_ids")
            topk_weights, topk_ids = self._select_experts(router_logits, self.top_k, self.renormalize)
        out = self.quant_method.apply(self, hidden, topk_weights, topk_ids)
        if self.tp_size > 1 and self.reduce_results:
            out = tensor_parallel_all_reduce(out)
        return out

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
            f"intermediate={self.intermediate_size_per_partition}/{self.intermediate_size}, renormalize={self.renormalize}, "
            f"tp={self.tp_rank}/{self.tp_size}, method={type(self.quant_method).__name__}"
        )
