"""The text model of Gemma multimodal checkpoints: ``Gemma3ForConditionalGeneration`` (Gemma 3
4B / 12B / 27B) on the Gemma 3 decoder of ``model.py``, ``Gemma4ForConditionalGeneration`` on
Gemma 4's (``gemma4.py``). The wrapper's names map onto the text model's
(:mod:`framework.loader.text_only`); the vision / audio towers and their projectors are skipped,
counted in one log line. Images and audio are the multimodal work's: these classes serve the
text path (token ids and text).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from framework.loader.model_loader import load_parameters
from framework.loader.text_only import text_model_weights

from .gemma4 import Gemma4ForCausalLM
from .model import GemmaForCausalLM

#: Prefixes of the encoders and their projectors (not served yet).
ENCODER_PREFIXES = tuple(
    f"{root}{part}."
    for root in ("", "model.")
    for part in ("vision_tower", "multi_modal_projector", "audio_tower", "embed_vision", "embed_audio")
)


class Gemma3ForConditionalGeneration(GemmaForCausalLM):
    """Gemma 3 4B / 12B / 27B, text only: ``forward(input_ids, positions) -> hidden``; ``compute_logits``."""

    #: encoder tensors are skipped unread; the text ones reach the layers' loaders as they came
    reads_checkpoint_slices = True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_parameters(self, text_model_weights(weights, ENCODER_PREFIXES, self.config.architecture))


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """Gemma 4, text only: ``forward(input_ids, positions) -> hidden``; ``compute_logits``."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(text_model_weights(weights, ENCODER_PREFIXES, self.config.architecture))
