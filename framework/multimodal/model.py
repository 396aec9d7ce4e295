"""The part every vision-language model class shares, beside its own tower and span layout: the
text decoder ``self.model`` (a :class:`~framework.layers.causal_lm.DecoderStack`) embeds the ids
and runs over the embeddings a step with image rows built (the contract of
:mod:`framework.engine.multimodal_step`)."""

from __future__ import annotations

import torch


class VisionLanguageModel:
    """A mixin, listed before the model's ``CausalLM`` base (its ``forward`` takes ``inputs_embeds``).

    The class gives ``image_token_id``, ``embed_image(pixel_values, grid)`` and either
    ``image_span_ids(grid)`` (whose length is :meth:`num_image_tokens`) or its own
    :meth:`num_image_tokens`.
    """

    def num_image_tokens(self, grid: list[int]) -> int:
        return len(self.image_span_ids(grid))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``inputs_embeds``: the token embeddings with the image rows (a step over image tokens);
        ``positions`` as the decoder takes them (``[3, T]`` M-RoPE positions for the Qwen-VL family)."""
        return self.model(input_ids, positions, inputs_embeds)
