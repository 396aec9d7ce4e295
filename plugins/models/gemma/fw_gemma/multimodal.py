"""The text model of Gemma multimodal checkpoints: ``Gemma3ForConditionalGeneration`` (Gemma 3
4B / 12B / 27B) on the Gemma 3 decoder of ``model.py``, ``Gemma4ForConditionalGeneration`` on
Gemma 4's (``gemma4.py``), under the wrapper's weight names.

Checkpoint names, by the transformers version that wrote them::

    language_model.model.layers.0...    (transformers 4, as Google released Gemma 3)  -> model.layers.0...
    model.language_model.layers.0...    (transformers 5 state dicts, Gemma 4)         -> model.layers.0...
    language_model.lm_head.weight / lm_head.weight                                    -> lm_head.weight (tied)
    vision / audio towers and their projectors (either prefix)                        -> skipped, counted in one log line

Images and audio are the multimodal work's: these classes serve the text path (token ids and text).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch

from framework.loader.model_loader import load_parameters

from .gemma4 import Gemma4ForCausalLM
from .model import GemmaForCausalLM

log = logging.getLogger("fw.loader")

#: Prefixes of the text model's tensors in a multimodal checkpoint -> fw's names.
TEXT_PREFIXES = {
    "language_model.model.": "model.",
    "model.language_model.": "model.",
    "language_model.lm_head.": "lm_head.",
    "lm_head.": "lm_head.",
}
#: Prefixes of the encoders and their projectors (not served yet).
ENCODER_PREFIXES = tuple(
    f"{root}{part}."
    for root in ("", "model.")
    for part in ("vision_tower", "multi_modal_projector", "audio_tower", "embed_vision", "embed_audio")
)


def text_weight_name(name: str) -> str | None:
    """The text model's name of checkpoint tensor ``name``; None for an encoder's tensor; an unknown
    name unchanged (the loader then names it as unmatched)."""
    if name.startswith(ENCODER_PREFIXES):
        return None
    for prefix, target in TEXT_PREFIXES.items():
        if name.startswith(prefix):
            return target + name.removeprefix(prefix)
    return name


def text_weights(weights: Iterable[tuple[str, torch.Tensor]], architecture: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The text model's tensors under its names, the encoders' skipped unread (one log line at the end)."""
    skipped = 0
    for name, tensor in weights:
        text_name = text_weight_name(name)
        if text_name is None:
            skipped += 1
        else:
            yield text_name, tensor
    if skipped:
        log.info(
            "%s: skipped %d vision/audio encoder and projector tensors; the text model is served, not its encoders",
            architecture,
            skipped,
        )


class Gemma3ForConditionalGeneration(GemmaForCausalLM):
    """Gemma 3 4B / 12B / 27B, text only: ``forward(input_ids, positions) -> hidden``; ``compute_logits``."""

    #: encoder tensors are skipped unread; the text ones reach the layers' loaders as they came
    reads_checkpoint_slices = True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_parameters(self, text_weights(weights, self.config.architecture))


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """Gemma 4, text only: ``forward(input_ids, positions) -> hidden``; ``compute_logits``."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(text_weights(weights, self.config.architecture))
