"""The text model of Gemma 3 multimodal checkpoints (``Gemma3ForConditionalGeneration``: Gemma 3
4B / 12B / 27B): the Gemma 3 decoder of ``model.py`` under the wrapper's weight names.

Checkpoint names, by the transformers version that wrote them::

    language_model.model.layers.0...    (transformers 4, as Google released them)  -> model.layers.0...
    model.language_model.layers.0...    (transformers 5 state dicts)               -> model.layers.0...
    language_model.lm_head.weight / lm_head.weight                                 -> lm_head.weight (tied)
    vision_tower.*, multi_modal_projector.* (either prefix)                        -> skipped, counted in one log line

Images are the vision work's: this class serves the text path, so prompts are token ids and text.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch

from framework.loader.model_loader import load_parameters

from .model import GemmaForCausalLM

log = logging.getLogger("fw.loader")

#: Prefixes of the text model's tensors in a multimodal checkpoint -> fw's names.
TEXT_PREFIXES = {
    "language_model.model.": "model.",
    "model.language_model.": "model.",
    "language_model.lm_head.": "lm_head.",
    "lm_head.": "lm_head.",
}
#: Prefixes of the image encoder and its projector (not served yet).
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def text_weight_name(name: str) -> str | None:
    """The text model's name of checkpoint tensor ``name``; None for a vision tensor; an unknown
    name unchanged (the loader then names it as unmatched)."""
    if name.startswith(VISION_PREFIXES):
        return None
    for prefix, target in TEXT_PREFIXES.items():
        if name.startswith(prefix):
            return target + name.removeprefix(prefix)
    return name


class Gemma3ForConditionalGeneration(GemmaForCausalLM):
    """Gemma 3 4B / 12B / 27B, text only: ``forward(input_ids, positions) -> hidden``; ``compute_logits``."""

    #: vision tensors are skipped unread; the text ones reach the layers' loaders as they came
    reads_checkpoint_slices = True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skipped = 0

        def text_only() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal skipped
            for name, tensor in weights:
                text_name = text_weight_name(name)
                if text_name is None:
                    skipped += 1
                else:
                    yield text_name, tensor

        loaded = load_parameters(self, text_only())
        if skipped:
            log.info(
                "%s: skipped %d vision-tower and projector tensors; the text model is served, images are not",
                self.config.architecture,
                skipped,
            )
        return loaded
