"""Qwen3.5 and Qwen3.5-MoE with images: the hybrid decoder of ``model.py`` fed by Qwen3-VL's vision
tower, with interleaved M-RoPE on its gated-attention layers.

The Hub's Qwen3.5 checkpoints (``Qwen3_5ForConditionalGeneration``,
``Qwen3_5MoeForConditionalGeneration``) hold ``model.language_model.*`` (the hybrid decoder),
``model.visual.*`` and ``lm_head``. What they share with Qwen3-VL (``fw_llama``, which this
plugin builds on) and what differs:

- the tower is Qwen3-VL's (:class:`~fw_llama.qwen3_vision.Qwen3VisionTransformer`: learned
  positions resampled to the grid, 2-D rotary, the patch merger) **without DeepStack**: the
  merger's output is the image embedding, ``[N, hidden]``, and the decoder takes it as an
  ordinary token embedding;
- the processor, placeholder token, prompt positions and weight names are Qwen2.5-VL's
  (:mod:`fw_llama.qwen2_5_vl`);
- M-RoPE interleaves its sections (``T H W T H W ...``) over the *partial* rotary frequencies
  of the attention layers (``partial_rotary_factor`` of each head; ``mrope_section`` adds up to
  half the rotated features, ``[11, 11, 10]`` by default). Only the gated-attention layers
  rotate; the Gated DeltaNet layers read no positions, and their per-sequence state (the engine's
  state cache) advances through image tokens as through text, step after step of a chunked
  prefill.

Text-only prompts take plain positions (the three sections equal), so the text path is the
hybrid model's unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fw_llama.qwen2_5_vl import (
    MRotaryEmbedding,
    Qwen2_5_VLForConditionalGeneration,
    QwenVisionLanguageModel,
    mrope_section,
)
from fw_llama.qwen3_vision import Qwen3VisionTransformer

from framework.config import ModelConfig
from framework.layers.causal_lm import CausalLM
from framework.multimodal.inputs import VisionSpec
from framework.quantization import QuantConfig

from .hooks import VISION_ARCHITECTURES
from .model import Qwen3NextForCausalLM

#: transformers' ``mrope_section`` when the checkpoint's ``rope_parameters`` give none
DEFAULT_MROPE_SECTION = (11, 11, 10)
#: transformers' ``image_token_id`` of Qwen3.5 (``<|image_pad|>``) when the config gives none
DEFAULT_IMAGE_TOKEN_ID = 248056


def image_token_id(config: ModelConfig) -> int:
    return int(config.get("image_token_id", DEFAULT_IMAGE_TOKEN_ID))


class Qwen3_5ForConditionalGeneration(QwenVisionLanguageModel, Qwen3NextForCausalLM):
    """Qwen3.5 checkpoints with their vision tower: the multimodal contract of
    :mod:`framework.engine.multimodal_step` (``vision_spec``, ``embed_image``,
    ``embed_input_ids``, ``rope_positions``: the Qwen-VL family's, from
    :class:`~fw_llama.qwen2_5_vl.QwenVisionLanguageModel`) over :class:`Qwen3NextForCausalLM`."""

    ignored_weight_patterns = (*CausalLM.ignored_weight_patterns, "mtp.")

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None = None, prefix: str = "") -> None:
        if config.architecture not in VISION_ARCHITECTURES:  # dense or MoE: model.py tells them apart
            raise ValueError(
                f"Qwen3_5ForConditionalGeneration serves {', '.join(VISION_ARCHITECTURES)}; got {config.architecture!r}"
            )
        vision = config.hf_config.get("vision_config") or {}
        out_hidden = int(vision.get("out_hidden_size", 3584))
        if out_hidden != config.hidden_size:
            raise ValueError(
                f"vision_config.out_hidden_size {out_hidden} must equal the text model's hidden_size "
                f"{config.hidden_size}: the tower's output is the image tokens' embedding"
            )
        super().__init__(config, quant_config, prefix)
        self.visual = Qwen3VisionTransformer({**vision, "deepstack_visual_indexes": []})
        self.image_token_id = image_token_id(config)
        section = mrope_section(config, DEFAULT_MROPE_SECTION)
        for layer in self.model.layers:
            if not layer.is_linear:
                attention = layer.self_attn
                attention.rotary_emb = MRotaryEmbedding(attention.rotary_emb, section, interleaved=True)

    @classmethod
    def vision_spec(cls, config: ModelConfig, preprocessor_config: dict[str, Any]) -> VisionSpec:
        """Qwen2-VL's processor with the tower's patch and merge sizes (Qwen3-VL's 16-pixel patches)."""
        if config.get("image_token_id") is None:
            config = dataclasses.replace(
                config, hf_config={**config.hf_config, "image_token_id": image_token_id(config)}
            )
        return Qwen2_5_VLForConditionalGeneration.vision_spec(config, preprocessor_config)

    @staticmethod
    def map_weight_name(name: str) -> tuple[str, tuple | None]:
        """``model.visual.*`` onto ``visual.*`` (loaded whole); the language model as
        :meth:`Qwen3NextForCausalLM.map_weight_name` folds it."""
        if name.startswith("model.visual."):
            return name.removeprefix("model."), ()
        return Qwen3NextForCausalLM.map_weight_name(name)
