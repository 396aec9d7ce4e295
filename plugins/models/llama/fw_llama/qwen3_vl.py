"""Qwen3-VL (dense and MoE): the Qwen3 / Qwen3-MoE decoder with interleaved M-RoPE and DeepStack,
and the vision tower of ``qwen3_vision``.

The multimodal contract is Qwen2.5-VL's (:mod:`fw_llama.qwen2_5_vl`: the processor, placeholder
token, prompt positions and weight names are the same); two things differ:

- M-RoPE interleaves the sections over the rotary frequencies (``T H W T H W ...``,
  :func:`~fw_llama.qwen2_5_vl.frequency_sections`) where Qwen2.5-VL gives each a contiguous run;
- DeepStack: ``embed_image`` returns ``[N, hidden * (1 + k)]`` (the merged image embeddings, then
  the features of ``k`` vision blocks), and the decoder adds block ``j``'s features to the hidden
  states of the image tokens after its layer ``j``. The features travel in the step's
  ``inputs_embeds``, which :meth:`Qwen3VLForConditionalGeneration.embed_input_ids` makes as wide
  with zeros in the text rows (so a text token's ``hidden + 0`` is unchanged)::

      inputs_embeds [T, hidden * (1 + k)]:  | token or image embedding | layer 0 | ... | layer k - 1 |

Qwen3-VL-MoE's experts are stacked ``mlp.experts.gate_up_proj`` / ``down_proj`` tensors, stored
``[E, hidden, 2I]`` / ``[E, I, hidden]`` in the released checkpoints and ``[E, 2I, hidden]`` /
``[E, hidden, I]`` as transformers 5 saves them: :meth:`Qwen3VLMoeForConditionalGeneration.load_weights`
takes either (transposing a tensor whose shape is not the parameter's, as transformers does).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from framework.config import ModelConfig
from framework.layers import residual_norm
from framework.layers.fused_moe import map_expert_weight_name
from framework.layers.mlp import MLPFactory, dense_mlp
from framework.loader.checkpoint_slice import materialize
from framework.loader.model_loader import load_parameters
from framework.quantization import QuantConfig
from fw_llama.model import LlamaModel
from fw_llama.moe import moe_or_dense_mlp
from fw_llama.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration, text_config
from fw_llama.qwen3_vision import Qwen3VisionTransformer


class DeepStackDecoder(LlamaModel):
    """A Llama-family decoder whose first ``num_deepstack`` layers add image features to their output
    (``inputs_embeds`` as wide as the module docstring draws it; ``[T, hidden]`` or None: no features)."""

    def __init__(
        self,
        config: ModelConfig,
        quant_config: QuantConfig | None,
        prefix: str,
        num_deepstack: int,
        make_mlp: MLPFactory = dense_mlp,
    ) -> None:
        super().__init__(config, quant_config, prefix, make_mlp)
        if num_deepstack > len(self.layers):
            raise ValueError(f"{num_deepstack} DeepStack vision layers for a decoder of {len(self.layers)} layers")
        self.hidden_size, self.num_deepstack = config.hidden_size, num_deepstack

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        features = None
        if inputs_embeds is None:
            hidden = self.embed(input_ids)
        elif inputs_embeds.shape[-1] == self.hidden_size:
            hidden = inputs_embeds
        else:
            hidden, features = inputs_embeds[:, : self.hidden_size], inputs_embeds[:, self.hidden_size :]
            features = features.view(hidden.shape[0], self.num_deepstack, self.hidden_size)
        residual = None
        for index, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual)
            if features is not None and index < self.num_deepstack:
                # the layer's output (the residual add the next norm would fuse), plus the features
                hidden, residual = residual + hidden + features[:, index], None
        hidden, _ = residual_norm(self.norm, hidden, residual)  # no residual left when every layer had features
        return hidden


class Qwen3VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    """``Qwen3VLForConditionalGeneration`` checkpoints: ``model.language_model.*`` (Qwen3 text),
    ``model.visual.*`` (the DeepStack tower) and ``lm_head``."""

    text_architecture = "Qwen3ForCausalLM"
    interleaved_mrope = True
    default_mrope_section = (24, 20, 20)
    make_mlp = staticmethod(dense_mlp)

    def build_tower(self, vision_config: dict[str, Any]) -> nn.Module:
        return Qwen3VisionTransformer(vision_config)

    def build_decoder(self, text: ModelConfig, quant_config: QuantConfig | None) -> nn.Module:
        return DeepStackDecoder(text, quant_config, "model", len(self.visual.deepstack_visual_indexes), self.make_mlp)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T, hidden * (1 + k)]``: the token embeddings, zeros where the DeepStack features go."""
        embeds = self.model.embed(input_ids)
        return torch.nn.functional.pad(embeds, (0, self.model.num_deepstack * embeds.shape[-1]))


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration):
    """``Qwen3VLMoeForConditionalGeneration`` checkpoints: Qwen3-MoE text (softmax top-k routing,
    always renormalised), the same tower."""

    text_architecture = "Qwen3MoeForCausalLM"
    make_mlp = staticmethod(moe_or_dense_mlp)

    def text_config(self, config: ModelConfig) -> ModelConfig:
        text = text_config(config, self.text_architecture)
        text.hf_config["norm_topk_prob"] = True  # transformers' router always renormalises the top k
        return text

    @staticmethod
    def map_weight_name(name: str) -> tuple[str, tuple | None]:
        name, args = Qwen2_5_VLForConditionalGeneration.map_weight_name(name)
        return (name, args) if args is not None else map_expert_weight_name(name)

    #: lazy slices go on to the layers (a GGUF's packed expert stacks); only a stack to transpose is read whole
    reads_checkpoint_slices = True

    def load_weights(self, weights) -> set[str]:
        params = dict(self.named_parameters())

        def laid_out(name: str, tensor: torch.Tensor) -> torch.Tensor:
            if not name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                return tensor  # not a fused HF stack (a GGUF's per-projection stacks are laid out already)
            target, _ = self.map_weight_name(name)
            param = params.get(target)
            if param is None or len(tensor.shape) != 3 or tuple(tensor.shape) == tuple(param.shape):
                return tensor
            return materialize(tensor).transpose(1, 2)  # the released checkpoints' [E, in, out]

        return load_parameters(self, ((name, laid_out(name, tensor)) for name, tensor in weights))
