"""The quantization seam: a :class:`QuantConfig` gives each layer its quant method.

A quantization plugin registers a ``QuantMethodSpec`` whose ``impl`` is its ``QuantConfig``
subclass. When a model is loaded, the engine resolves the method name
(``resolve_quantization_method``), builds the config once with :func:`build_quant_config`
(``QuantConfig.from_config``, seeing the model config), checks it against the model's dtype and
device (:meth:`QuantConfig.verify`) and passes it to the model class, which hands it to every
layer it builds. Each layer asks :meth:`QuantConfig.get_quant_method` for the method that
creates, post-processes and applies its weights (vLLM's create-weights / process-after-loading /
apply split)::

    linear layers, VocabEmbedding, LMHead   -> LinearMethod    (default UnquantizedLinearMethod)
    FusedMoE                                -> FusedMoEMethod  (default UnquantizedFusedMoEMethod)
    Attention                               -> the KV-cache method (None until KV quantization)

After the layers are built (still before any weight is read) the engine checks every method
against the model's dtype and device (:func:`verify_quant_methods`); after the weights are
loaded, ``framework.loader.model_loader.finish_loading`` calls each module's
``quant_method.process_weights_after_loading``.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

from framework.errors import ConfigError

if TYPE_CHECKING:
    from framework.config import ModelConfig


def _names(dtypes: frozenset[torch.dtype]) -> str:
    return ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))


def check_supported(
    what: str,
    supported_act_dtypes: frozenset[torch.dtype] | None,
    supported_device_types: frozenset[str] | None,
    dtype: torch.dtype,
    device_type: str,
) -> None:
    """Raise :class:`ConfigError` when ``dtype`` / ``device_type`` is outside what ``what`` supports
    (``None``: anything), naming what is supported."""
    if supported_act_dtypes is not None and dtype not in supported_act_dtypes:
        raise ConfigError(
            f"{what} does not support activations in {str(dtype).removeprefix('torch.')}; "
            f"supported: {_names(supported_act_dtypes)} (choose one with --dtype)"
        )
    if supported_device_types is not None and device_type not in supported_device_types:
        raise ConfigError(
            f"{what} does not run on {device_type}; supported devices: {', '.join(sorted(supported_device_types))}"
        )


class QuantMethodBase:
    """What every quant method shares: its capabilities and the post-loading step.

    ``supported_act_dtypes`` / ``supported_device_types`` (``None``: any) are checked by the
    engine before any weight is read; an impossible combination is a ``ConfigError``.
    """

    supported_act_dtypes: ClassVar[frozenset[torch.dtype] | None] = None
    supported_device_types: ClassVar[frozenset[str] | None] = None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once after all checkpoint tensors are loaded (repack, transpose, dequantize on CPU)."""
        return None


class LinearMethod(QuantMethodBase, ABC):
    """How one linear layer (or vocabulary table) stores and multiplies its weights.

    Lifecycle, in order: :meth:`create_weights` from the layer's constructor (possibly on the
    ``meta`` device); the loader copies checkpoint tensors through each parameter's
    ``weight_loader``; :meth:`process_weights_after_loading` once; :meth:`apply` every forward.
    """

    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        """Register this rank's parameters on ``layer``.

        ``output_partition_sizes`` are this rank's output features per fused shard (``[q, k, v]``
        for QKV, ``[gate, up]`` for gate_up, one entry otherwise); ``input_size`` and
        ``output_size`` are the unsharded sizes. Every parameter gets ``weight_loader`` (use
        ``layer.weight_loader`` unless the format needs its own) and ``output_dim`` /
        ``input_dim`` (see :mod:`framework.layers.linear`). A quantity kept per fused shard (a
        per-tensor scale of each of q, k, v) is a parameter with ``per_shard=True`` and one
        entry per shard along dim 0; the layer's loader fills entry ``i`` from shard ``i``.
        Create tensors with ``torch.empty`` so that a ``meta`` device context applies.
        Parameters are inference-only (``requires_grad=False``).
        """

    @abstractmethod
    def apply(self, layer: nn.Module, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """``x @ W.T + bias`` for ``x`` ``[..., input_size_per_partition]``; no communication."""

    def dequantize(self, layer: nn.Module) -> Tensor:
        """This rank's weight as a dense ``[output_size_per_partition, input_size_per_partition]``
        tensor in ``layer.params_dtype`` (``apply(x) == x @ dequantize().T`` up to rounding)."""
        raise NotImplementedError(f"{type(self).__name__} cannot dequantize its weights")

    def activation_group(self, layer: nn.Module, x: Tensor) -> int | None:
        """The group size ``g`` if :meth:`apply` on this ``x`` rounds the activations to int8,
        symmetric per ``g`` consecutive input features (scale ``max |x| / 127`` of the group, as
        llama.cpp's integer GEMVs do), else ``None`` (the default: x is multiplied as given). The
        conformance kit then allows, per output, the error that rounding can make."""
        return None

    def embedding(self, layer: nn.Module, input_ids: Tensor) -> Tensor:
        """Rows ``input_ids`` of the weight, for a ``VocabEmbedding`` using this method."""
        raise NotImplementedError(f"{type(self).__name__} cannot be used for an embedding table")


class FusedMoEMethod(QuantMethodBase, ABC):
    """How one :class:`~framework.layers.fused_moe.FusedMoE` stores and runs its experts.

    Lifecycle as :class:`LinearMethod`. Checkpoint tensors reach the parameters named
    ``w13_<suffix>`` / ``w2_<suffix>`` (``...experts.{e}.gate_proj.qweight`` ->
    ``w13_qweight``; see :func:`framework.layers.fused_moe.expert_weight_target`), through the
    parameter's ``weight_loader(param, tensor, shard_id, expert_id)`` (use
    ``layer.weight_loader`` with the attributes it documents, or the method's own).

    ``supports_moe_activation``: the method creates the layer's biases
    (``framework.layers.fused_moe.create_expert_biases``) and honours ``layer.activation()``
    (gpt-oss's biased experts and clamped SwiGLU); a FusedMoE needing them refuses other methods.
    """

    supports_moe_activation: ClassVar[bool] = False

    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
    ) -> None:
        """Register this rank's expert parameters on ``layer`` (every expert; ``intermediate_size_per_partition``
        of each expert's intermediate features), with ``torch.empty`` as :meth:`LinearMethod.create_weights`."""

    @abstractmethod
    def apply(self, layer: nn.Module, hidden: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        """``[T, H]``: per token, the ``topk_weights``-weighted sum of its ``topk_ids`` experts'
        SwiGLU outputs (see ``framework.ops.fused_moe``), this rank's partial sum; no communication."""

    def dequantize(self, layer: nn.Module) -> tuple[Tensor, Tensor]:
        """``(w13 [E, 2 * I, H], w2 [E, H, I])`` dense in ``layer.params_dtype`` (``I``: this rank's
        intermediate features; gate rows then up rows), the weights :meth:`apply` multiplies by."""
        raise NotImplementedError(f"{type(self).__name__} cannot dequantize its experts")


class QuantConfig(ABC):
    """A checkpoint's quantization settings, and the factory of its layers' quant methods.

    Instances are built once per model and shared by every layer; they hold settings only
    (bits, group size, which modules stay unquantized), never tensors.

    ``packed_modules_mapping`` is set by the engine, before the model is built, to the model
    class's mapping of checkpoint names onto fused layers (``{"q_proj": ("qkv_proj", "q"),
    ...}``), for methods whose settings are per checkpoint tensor.

    ``supported_act_dtypes`` / ``supported_device_types`` (``None``: any) say where the
    format runs at all; :meth:`verify` refuses the rest before any weight is read.
    """

    packed_modules_mapping: dict[str, tuple[str, Any]] = {}
    supported_act_dtypes: ClassVar[frozenset[torch.dtype] | None] = None
    supported_device_types: ClassVar[frozenset[str] | None] = None

    @classmethod
    @abstractmethod
    def get_name(cls) -> str:
        """The method's registry name (``"gguf"``, ``"gptq"``, ...), as its QuantMethodSpec names it."""

    @abstractmethod
    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantMethodBase | None:
        """The quant method for ``layer``, or ``None`` to leave it unquantized.

        Called once per layer, from the layer's constructor, before any weight exists (the
        layer may be on the ``meta`` device; ``framework.kernels.target_device()`` names the
        device it will run on). ``layer`` is one of (check with ``isinstance``):

        * a linear layer, a ``VocabEmbedding`` or an ``LMHead``: return a :class:`LinearMethod`;
          its sizes (``input_size``, ``output_size``, ``output_partition_sizes``, ...) are set;
        * a ``FusedMoE``: return a :class:`FusedMoEMethod`; ``num_experts``, ``hidden_size``,
          ``intermediate_size_per_partition``, ``tp_size`` / ``tp_rank`` are set;
        * an ``Attention`` layer: the KV-cache method (``None`` until KV-cache quantization).

        ``prefix`` is the layer's dotted name in the model (``"model.layers.0.self_attn.qkv_proj"``),
        for configs that skip some modules. A returned method may be shared between layers.
        """

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any], model_config: ModelConfig | None = None) -> QuantConfig:
        """Build the config from the checkpoint's quantization settings.

        ``config`` is ``config.json``'s ``quantization_config`` for Hugging Face checkpoints,
        or what the weight format reports (GGUF, ISQ); missing required keys raise
        ``ValueError`` naming them. ``model_config`` is the model being built (its dtype,
        sizes); an override may leave it out of its signature.
        """

    @classmethod
    def for_isq(
        cls, isq_type: str, model_config: ModelConfig, weight_shapes: dict[str, tuple[int, ...]]
    ) -> QuantConfig:
        """The config for in-situ quantization ``--isq isq_type`` (one of the spec's ``isq_types``)
        of a 16-bit checkpoint holding ``weight_shapes`` (name -> shape); see :mod:`framework.isq`."""
        raise NotImplementedError(f"{cls.__name__} offers no in-situ quantization")

    def quantize_weight(self, name: str, weight: Tensor) -> list[tuple[str, Tensor]] | None:
        """For a config made by :meth:`for_isq`: the checkpoint tensors of this format that replace the
        dense matrix ``name`` (on the target device), or ``None`` to keep it dense."""
        raise NotImplementedError(f"{type(self).__name__} offers no in-situ quantization")

    def verify(self, model_config: ModelConfig, device: torch.device) -> None:
        """Raise :class:`ConfigError` when this config cannot run ``model_config`` (its activation
        dtype) on ``device``; the default checks the ``supported_*`` class attributes."""
        check_supported(
            f"quantization {self.get_name()!r}",
            self.supported_act_dtypes,
            self.supported_device_types,
            model_config.dtype,
            torch.device(device).type,
        )


def quant_method_for(
    quant_config: QuantConfig | None, layer: nn.Module, prefix: str, expected: type[QuantMethodBase], what: str
) -> Any:
    """``quant_config``'s method for ``layer`` (None without a config or for an unquantized layer),
    refusing with ``TypeError`` one of the wrong kind: ``expected`` is :class:`LinearMethod` for
    linear layers and vocabulary tables, :class:`FusedMoEMethod` for ``FusedMoE``, and
    :class:`QuantMethodBase` (neither of those) for attention layers."""
    method = quant_config.get_quant_method(layer, prefix) if quant_config is not None else None
    if method is None:
        return None
    wrong = not isinstance(method, expected) or (
        expected is QuantMethodBase and isinstance(method, LinearMethod | FusedMoEMethod)
    )
    if wrong:
        wanted = "a KV-cache method" if expected is QuantMethodBase else f"a {expected.__name__}"
        raise TypeError(
            f"{prefix}: {type(quant_config).__name__}.get_quant_method returned {type(method).__name__} "
            f"for {what}; expected {wanted} or None"
        )
    return method


def build_quant_config(
    config_cls: type[QuantConfig], checkpoint: dict[str, Any], model_config: ModelConfig, device: torch.device
) -> QuantConfig:
    """``config_cls.from_config`` (passing ``model_config`` when its signature takes it), verified
    against ``model_config``'s dtype and ``device``."""
    takes_model = "model_config" in inspect.signature(config_cls.from_config).parameters
    quant_config = (
        config_cls.from_config(checkpoint, model_config=model_config)
        if takes_model
        else config_cls.from_config(checkpoint)
    )
    quant_config.verify(model_config, device)
    return quant_config


def verify_quant_methods(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse, with a :class:`ConfigError` naming the layer, a model one of whose quant methods
    does not support activations in ``dtype`` or the ``device``; called before weights are read."""
    seen: set[type] = set()  # the capabilities are per class: one check each
    device_type = torch.device(device).type
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None or type(method) in seen:
            continue
        seen.add(type(method))
        check_supported(
            f"{name or 'the model'}'s {type(method).__name__}",
            method.supported_act_dtypes,
            method.supported_device_types,
            dtype,
            device_type,
        )


def is_module_listed(prefix: str, patterns: list[str]) -> bool:
    """Whether the layer ``prefix`` is named by a checkpoint's list of modules to leave unquantized
    (``modules_to_not_convert``, compressed-tensors' ``ignore``): a pattern ``"re:<regex>"`` matches
    from the start of ``prefix``; any other names the module itself, a suffix or a dotted part of it."""
    import re

    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], prefix):
                return True
        elif prefix == pattern or prefix.endswith(f".{pattern}") or f".{pattern}." in f".{prefix}.":
            return True
    return False
