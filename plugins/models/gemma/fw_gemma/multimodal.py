"""The text model of Gemma 4 multimodal checkpoints: ``Gemma4ForConditionalGeneration`` on Gemma
4's decoder (``gemma4.py``). The wrapper's names map onto the text model's
(:mod:`framework.loader.text_only`); the vision / audio towers and their projectors are skipped,
counted in one log line. (Gemma 3 takes images: ``gemma3_vl.py``.)
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from framework.loader.text_only import text_model_weights

from .gemma4 import Gemma4ForCausalLM

#: Prefixes of the encoders and their projectors (not served yet).
ENCODER_PREFIXES = tuple(
    f"{root}{part}."
    for root in ("", "model.")
    for part in ("vision_tower", "multi_modal_projector", "audio_tower", "embed_vision", "embed_audio")
)


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """Gemma 4, text only: ``forward(input_ids, positions) -> hidden``; ``compute_logits``."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(text_model_weights(weights, ENCODER_PREFIXES, self.config.architecture))
