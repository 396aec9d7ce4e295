"""The quantization seam: a :class:`QuantConfig` gives each linear layer its ``LinearMethod``.

A quantization plugin registers a ``QuantMethodSpec`` whose ``impl`` is its ``QuantConfig``
subclass. When a model is loaded, the engine resolves the method name
(``resolve_quantization_method``), builds the config once with :meth:`QuantConfig.from_config`
and passes it to the model class, which hands it to every layer it builds. Each layer asks
:meth:`QuantConfig.get_linear_method` for the method that creates, post-processes and
multiplies its weights (vLLM's create-weights / process-after-loading / apply split, see
:class:`framework.layers.linear.LinearMethod`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from framework.layers.linear import LinearMethod


class QuantConfig(ABC):
    """A checkpoint's quantization settings, and the factory of its layers' LinearMethods.

    Instances are built once per model and shared by every layer; they hold settings only
    (bits, group size, which modules stay unquantized), never tensors.

    ``packed_modules_mapping`` is set by the engine, before the model is built, to the model
    class's mapping of checkpoint names onto fused layers (``{"q_proj": ("qkv_proj", "q"),
    ...}``), for methods whose settings are per checkpoint tensor.
    """

    packed_modules_mapping: dict[str, tuple[str, Any]] = {}

    @classmethod
    @abstractmethod
    def get_name(cls) -> str:
        """The method's registry name (``"gguf"``, ``"gptq"``, ...), as its QuantMethodSpec names it."""

    @abstractmethod
    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        """The LinearMethod for ``layer``, or ``None`` to leave that layer unquantized.

        Called once per layer, from the layer's constructor, before any weight exists (the
        layer may be on the ``meta`` device). ``layer`` is a linear layer, a ``VocabEmbedding``
        or an ``LMHead`` (check with ``isinstance``); its sizes (``input_size``,
        ``output_size``, ``output_partition_sizes``, ...) are already set. ``prefix`` is the
        layer's dotted name in the model (``"model.layers.0.self_attn.qkv_proj"``), for
        configs that skip some modules. A returned method may be shared between layers.
        """

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> QuantConfig:
        """Build the config from the checkpoint's quantization settings.

        ``config`` is ``config.json``'s ``quantization_config`` for Hugging Face checkpoints,
        or what the weight format reports (GGUF, ISQ); missing required keys raise
        ``ValueError`` naming them.
        """
