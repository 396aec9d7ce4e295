"""Qwen2.5-VL: the Qwen2 decoder with multimodal RoPE, and the vision tower of ``qwen2_5_vision``.

The model follows fw's multimodal contract (:mod:`framework.engine.multimodal_step`):
``vision_spec`` (its image processor and placeholder token), ``embed_image`` (one image's
embeddings), ``embed_input_ids``, ``forward(input_ids, positions, inputs_embeds=None)`` and
``rope_positions``. M-RoPE splits each head's rotary frequencies into three sections
(``mrope_section``) that rotate by a token's temporal, height and width position::

    text token at index i (after images):   (p, p, p),  p = i + delta (the images' shrinkage)
    image token at block (row r, col c):     (s, s + r, s + c),  s = the position after the text before it

so ``positions`` is ``[3, T]`` in a step that covers image tokens and ``[T]`` (``p`` for all
three sections, plain RoPE) otherwise.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from framework.config import ModelConfig
from framework.layers import norm_per_head
from framework.layers.causal_lm import CausalLM
from framework.layers.rotary import RotaryEmbedding
from framework.multimodal.inputs import VisionSpec
from framework.multimodal.model import VisionLanguageModel
from framework.quantization import QuantConfig
from fw_llama.model import LlamaModel
from fw_llama.qwen2_5_vision import Qwen2_5VisionTransformer
from fw_llama.qwen2_vl_processor import processor_settings


def frequency_sections(mrope_section: list[int], interleaved: bool) -> list[int]:
    """The section (0: temporal, 1: height, 2: width) of each rotary frequency.

    Qwen2.5-VL gives each section a contiguous run (``[0] * s0 + [1] * s1 + [2] * s2``); Qwen3-VL
    interleaves them, ``T H W T H W ...``, until the height and width runs are used up::

        frequency j:  1 if j % 3 == 1 and j < 3 * s1;  2 if j % 3 == 2 and j < 3 * s2;  else 0
    """
    if not interleaved:
        return [index for index, width in enumerate(mrope_section) for _ in range(width)]
    _, height, width = mrope_section
    return [
        1 if j % 3 == 1 and j < 3 * height else 2 if j % 3 == 2 and j < 3 * width else 0
        for j in range(sum(mrope_section))
    ]


class MRotaryEmbedding(nn.Module):
    """M-RoPE over a default :class:`RotaryEmbedding` (NeoX pairs): ``[T]`` positions rotate as the
    base does; ``[3, T]`` positions pick each frequency's row from its section's position
    (:func:`frequency_sections`)."""

    def __init__(self, base: RotaryEmbedding, mrope_section: list[int], interleaved: bool = False) -> None:
        super().__init__()
        if sum(mrope_section) != base.rotary_dim // 2:
            raise ValueError(f"mrope_section {mrope_section} must add up to rotary_dim / 2 = {base.rotary_dim // 2}")
        self.base = base
        section = frequency_sections(mrope_section, interleaved)  # of each cos and each sin column
        self.section = section + section
        self._section_index: dict[torch.device, torch.Tensor] = {}  # self.section on each device, made once

    def _token_table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, table)``: each token's own ``[T, rotary_dim]`` cos | sin row of ``[3, T]`` positions."""
        rows = self.base.cos_sin_cache[positions]  # [3, T, rotary_dim]: cos | sin per section
        section = self._section_index.get(positions.device)
        if section is None:
            section = self._section_index[positions.device] = torch.tensor(self.section, device=positions.device)
        index = section.view(1, 1, -1).expand(1, rows.shape[1], -1)
        table = rows.gather(0, index)[0]
        return torch.arange(table.shape[0], device=positions.device), table

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
        base = self.base
        if positions.ndim == 1:
            return base(positions, query, key)
        token_rows, table = self._token_table(positions)
        return base._kernel(token_rows, query, key, base.head_size, table, base.is_neox_style)

    def forward_with_qk_norm(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, q_norm: nn.Module, k_norm: nn.Module
    ):
        """:meth:`RotaryEmbedding.forward_with_qk_norm` (Qwen3's per-head QK norm) with M-RoPE positions."""
        base = self.base
        if positions.ndim == 1:
            return base.forward_with_qk_norm(positions, query, key, q_norm, k_norm)
        head = base.head_size
        return self.forward(positions, norm_per_head(q_norm, query, head), norm_per_head(k_norm, key, head))


def text_config(config: ModelConfig, architecture: str = "Qwen2ForCausalLM") -> ModelConfig:
    """The decoder's config: ``text_config`` over the top level, served as ``architecture`` (Qwen2:
    q/k/v bias) with plain rope (M-RoPE wraps it). The top level's ``tie_word_embeddings`` wins, as
    in transformers (Qwen3-VL's text configs default it to true where the checkpoint does not tie)."""
    hf = dict(config.hf_config)
    hf.update(hf.get("text_config") or {})
    if "tie_word_embeddings" in config.hf_config:
        hf["tie_word_embeddings"] = config.hf_config["tie_word_embeddings"]
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(hf.get(key), dict):
            hf[key] = {k: v for k, v in hf[key].items() if k in ("rope_theta",)}
    hf.pop("text_config", None)
    return dataclasses.replace(config, hf_config=hf, architecture=architecture)


def mrope_section(config: ModelConfig, default: tuple[int, ...] = (16, 24, 24)) -> list[int]:
    """The config's ``mrope_section``, else ``default`` (transformers' for the family member)."""
    for source in (config.rope_parameters, config.get("rope_scaling") or {}):
        if source.get("mrope_section"):
            return list(source["mrope_section"])
    return list(default)


def prompt_mrope_positions(
    num_tokens: int, spans: list[tuple[int, int, list[int]]], merge: int
) -> tuple[torch.Tensor, int]:
    """The ``[3, num_tokens]`` M-RoPE positions of a prompt whose images take the ``(offset,
    length, grid)`` spans (the module docstring's layout, ``merge`` the tower's spatial merge),
    and the delta that later tokens add to their index."""
    parts, position, previous = [], 0, 0
    for offset, length, (t, h, w) in spans:
        parts.append(torch.arange(offset - previous).expand(3, -1) + position)
        position += offset - previous
        grid = torch.stack(
            torch.meshgrid(torch.arange(t), torch.arange(h // merge), torch.arange(w // merge), indexing="ij")
        )
        parts.append(grid.reshape(3, -1) + position)
        position += max(h, w) // merge
        previous = offset + length
    parts.append(torch.arange(num_tokens - previous).expand(3, -1) + position)
    positions = torch.cat(parts, dim=1)
    return positions, int(positions.max()) + 1 - num_tokens


class QwenVisionLanguageModel(VisionLanguageModel):
    """The Qwen-VL family's image side (Qwen2.5-VL, Qwen3-VL, Qwen3.5): the tower ``self.visual``
    gives an image's tokens and embeddings; the prompt's positions are M-RoPE's."""

    def num_image_tokens(self, grid: list[int]) -> int:
        return self.visual.num_tokens(grid)

    def embed_image(self, pixel_values: torch.Tensor, grid: list[int]) -> torch.Tensor:
        """``[num_image_tokens(grid), hidden]``: one image through the tower."""
        return self.visual(pixel_values, grid)

    def rope_positions(self, num_tokens: int, spans: list[tuple[int, int, list[int]]]) -> tuple[torch.Tensor, int]:
        """The prompt's ``[3, num_tokens]`` M-RoPE positions and the delta of later tokens
        (:func:`prompt_mrope_positions` of this model's tower, its ``merge``)."""
        return prompt_mrope_positions(num_tokens, spans, self.visual.merge)


class Qwen2_5_VLForConditionalGeneration(QwenVisionLanguageModel, CausalLM):
    """``Qwen2_5_VLForConditionalGeneration`` checkpoints: ``model.language_model.*`` (or the older
    ``model.*``), ``model.visual.*`` (or ``visual.*``) and ``lm_head``.

    The Qwen-VL family shares this class: a member overrides ``text_architecture`` (the decoder's
    layout), ``interleaved_mrope``, ``default_mrope_section``, :meth:`text_config`,
    :meth:`build_tower` and :meth:`build_decoder` (Qwen3-VL: ``qwen3_vl.py``).
    """

    text_architecture = "Qwen2ForCausalLM"
    interleaved_mrope = False
    default_mrope_section = (16, 24, 24)

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.config = config
        text = self.text_config(config)
        self.visual = self.build_tower(config.hf_config.get("vision_config") or {})
        self.model = self.build_decoder(text, quant_config)
        self.init_lm_head(text, quant_config, tie_by_default=False)
        self.image_token_id = int(config.get("image_token_id"))
        section = mrope_section(config, self.default_mrope_section)
        for layer in self.model.layers:
            attention = layer.self_attn
            attention.rotary_emb = MRotaryEmbedding(attention.rotary_emb, section, self.interleaved_mrope)

    def text_config(self, config: ModelConfig) -> ModelConfig:
        return text_config(config, self.text_architecture)

    def build_tower(self, vision_config: dict[str, Any]) -> nn.Module:
        return Qwen2_5VisionTransformer(vision_config)

    def build_decoder(self, text: ModelConfig, quant_config: QuantConfig | None) -> nn.Module:
        return LlamaModel(text, quant_config, "model")

    @classmethod
    def vision_spec(cls, config: ModelConfig, preprocessor_config: dict[str, Any]) -> VisionSpec:
        settings = processor_settings(preprocessor_config)
        vision = config.hf_config.get("vision_config") or {}
        for key, name in (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size")):
            if key in vision:
                settings[name] = vision[key]
        if "spatial_merge_size" in vision:
            settings["merge_size"] = vision["spatial_merge_size"]
        return VisionSpec(
            processor="fw_llama.qwen2_vl_processor:Qwen2VLImageProcessor",
            processor_config=settings,
            image_token_id=int(config.get("image_token_id")),
        )

    @staticmethod
    def map_weight_name(name: str) -> tuple[str, tuple | None]:
        """transformers 5's names onto this module's; the tower's tensors load whole (no fusing)."""
        if name.startswith("model.language_model."):
            name = "model." + name.removeprefix("model.language_model.")
        elif name.startswith("model.visual."):
            name = name.removeprefix("model.")
        return name, (() if name.startswith("visual.") else None)
