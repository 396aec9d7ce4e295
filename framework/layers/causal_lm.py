"""What every decoder-only model class shares: the checkpoint-name folding and the LM head."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from framework.config import ModelConfig
from framework.layers.embedding import LMHead
from framework.quantization import QuantConfig

#: How Hugging Face checkpoint names fold into fw's fused layers (Llama-style decoders).
FUSED_QKV_GATE_UP = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


#: ``model.layers.{i}.``: the checkpoint prefix of decoder layer ``i``.
_LAYER_PREFIX = re.compile(r"^model\.layers\.(\d+)\.")


def drop_extra_layers(weights: Iterable[tuple[str, torch.Tensor]], num_layers: int) -> Iterator[tuple[str, object]]:
    """The checkpoint tensors without those of layers ``num_layers`` and up: DeepSeek-V3 and
    GLM-4.5 checkpoints append their multi-token-prediction layers after the decoder's
    (``model.layers.{num_hidden_layers}.*``), which plain decoding does not run."""
    for name, tensor in weights:
        match = _LAYER_PREFIX.match(name)
        if match is None or int(match[1]) < num_layers:
            yield name, tensor


class DecoderStack(nn.Module):
    """``embed_tokens`` -> ``layers`` -> ``norm``: the body of a decoder-only model.

    Subclasses build the three; each layer is called ``layer(positions, hidden, residual)`` and
    returns ``(hidden, residual)`` (the residual add is fused into the next norm). Override
    :meth:`embed` to scale embeddings (Gemma).
    """

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``inputs_embeds`` (a vision model's step): what :meth:`embed` gives for ``input_ids``,
        with image embeddings in the rows of image tokens."""
        hidden, residual = (self.embed(input_ids) if inputs_embeds is None else inputs_embeds), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class CausalLM(nn.Module):
    """Base of ``XForCausalLM`` classes: ``self.model`` maps ids to hidden states, the head to logits.

    Subclasses build ``self.model`` and call :meth:`init_lm_head`; they keep
    ``forward(input_ids, positions) -> hidden`` and ``compute_logits(hidden) -> logits``.
    """

    packed_modules_mapping: dict = FUSED_QKV_GATE_UP
    ignored_weight_patterns: tuple[str, ...] = ("rotary_emb.inv_freq",)

    def init_lm_head(self, config: ModelConfig, quant_config: QuantConfig | None, tie_by_default: bool) -> None:
        """Build ``lm_head``; tie it to the token embedding when ``tie_word_embeddings`` says so."""
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, quant_config=quant_config, prefix="lm_head")
        if config.get("tie_word_embeddings", tie_by_default):
            self.lm_head.tie_weights(self.model.embed_tokens)
            self.ignored_weight_patterns = (*self.ignored_weight_patterns, "lm_head.weight")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
