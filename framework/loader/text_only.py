"""The text model's tensors of a multimodal checkpoint, its encoders' skipped unread.

Multimodal wrappers (``Gemma3ForConditionalGeneration``, ``Llama4ForConditionalGeneration``, ...)
keep their language model under a prefix that depends on the transformers version that wrote
them, beside the vision (or audio) encoders::

    language_model.model.layers.0...    (transformers 4)            -> model.layers.0...
    model.language_model.layers.0...    (transformers 5 state dicts) -> model.layers.0...
    language_model.lm_head.weight / lm_head.weight                   -> lm_head.weight

A model class that serves only the text path renames the stream with :func:`text_model_weights`
and hands it to its usual loader (with ``reads_checkpoint_slices = True`` the skipped tensors are
never read).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch

log = logging.getLogger("fw.loader")

#: Where wrappers keep the text model's tensors -> the text model's own names.
TEXT_PREFIXES = {
    "language_model.model.": "model.",
    "model.language_model.": "model.",
    "language_model.lm_head.": "lm_head.",
    "lm_head.": "lm_head.",
}


def text_model_name(name: str, encoder_prefixes: tuple[str, ...]) -> str | None:
    """The text model's name of checkpoint tensor ``name``; None for a tensor under one of
    ``encoder_prefixes``; an unknown name unchanged (the loader then names it as unmatched)."""
    if name.startswith(encoder_prefixes):
        return None
    for prefix, target in TEXT_PREFIXES.items():
        if name.startswith(prefix):
            return target + name.removeprefix(prefix)
    return name


def text_model_weights(
    weights: Iterable[tuple[str, torch.Tensor]], encoder_prefixes: tuple[str, ...], architecture: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` under the text model's names, the encoders' tensors skipped (one log line
    counting them, once the stream is exhausted)."""
    skipped = 0
    for name, tensor in weights:
        text_name = text_model_name(name, encoder_prefixes)
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
