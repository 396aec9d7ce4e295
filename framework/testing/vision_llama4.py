"""A tiny random Llama 4 with images for tests (no download), written as
:mod:`framework.testing.vision` writes the other vision-language models: the word-level tokenizer's
ids are ``<s>`` 0, ``</s>`` 1, ``t2 .. t289`` and :data:`LLAMA4_SPECIALS`."""

from __future__ import annotations

from pathlib import Path

from framework.testing.vision import IMAGE_TOKEN_ID, write_vision_checkpoint

#: Llama 4's span tokens; ``<|patch|>`` (the image token) takes the embeddings, ``<|image|>`` is
#: the template's placeholder
LLAMA4_SPECIALS = {
    "<|header_start|>": 290,
    "<|header_end|>": 291,
    "<|image_start|>": 292,
    "<|image_end|>": 293,
    "<|patch|>": IMAGE_TOKEN_ID,
    "<|tile_x_separator|>": 295,
    "<|tile_y_separator|>": 296,
    "<|image|>": 297,
}
_LLAMA4_CHAT_TEMPLATE = (
    "{% for m in messages %}<|header_start|> t3 <|header_end|> {% if m.content is string %}{{ m.content }} "
    "{% else %}{% for p in m.content %}{% if p.type == 'image' %}<|image|> {% else %}{{ p.text }} {% endif %}"
    "{% endfor %}{% endif %}</s> {% endfor %}{% if add_generation_prompt %}<|header_start|> t4 <|header_end|> "
    "{% endif %}"
)
#: tiles of 32 pixels (8-pixel patches: 4 embeddings per tile), at most 4 tiles per canvas
_TINY_LLAMA4_PREPROCESSOR = {"size": {"height": 32, "width": 32}, "max_patches": 4, "resample": 2}


def write_tiny_llama4(path, seed: int = 0):
    """A random Llama 4 (text: hidden 64, 2 layers, the second NoPE and MoE (4 experts, top 1),
    chunks of 8 on the first; vision: hidden 32, 2 blocks, 32-pixel tiles of 8-pixel patches,
    pixel shuffle 0.5, projector width 64) written to ``path``; its config names the tile
    separators and ``<|image|>`` (``tile_x_separator_token_id``, ``tile_y_separator_token_id``,
    ``image_placeholder_token_id``: released configs do not; fw takes Llama 4's tokenizer ids).
    Returns the transformers model (fp32, eval, norms and biases randomised, the tower's query
    and key weights and the projector scaled up)."""
    import torch
    import transformers

    from framework.testing.model_writers import randomise_identity_params
    from framework.testing.tiny_configs import tiny_llama4_text

    path = Path(path)
    text = tiny_llama4_text(vocab_size=300, num_hidden_layers=2, bos_token_id=0, eos_token_id=1)
    vision = dict(
        hidden_size=32,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
        vision_output_dim=64,
        projector_input_dim=64,
        projector_output_dim=64,
        pixel_shuffle_ratio=0.5,
    )
    specials = LLAMA4_SPECIALS
    config = transformers.Llama4Config(
        text_config=text,
        vision_config=vision,
        boi_token_index=specials["<|image_start|>"],
        eoi_token_index=specials["<|image_end|>"],
        image_token_index=IMAGE_TOKEN_ID,
    )
    config.tile_x_separator_token_id = specials["<|tile_x_separator|>"]
    config.tile_y_separator_token_id = specials["<|tile_y_separator|>"]
    config.image_placeholder_token_id = specials["<|image|>"]
    torch.manual_seed(seed)
    model = transformers.Llama4ForConditionalGeneration(config).eval()
    randomise_identity_params(model)
    with torch.no_grad():  # sharper attention over patches (the 2-D rotary matters); images as loud as text
        for layer in model.vision_model.model.layers:
            layer.self_attn.q_proj.weight.mul_(12)
            layer.self_attn.k_proj.weight.mul_(12)
        model.multi_modal_projector.linear_1.weight.mul_(10)
    write_vision_checkpoint(
        path,
        model,
        _TINY_LLAMA4_PREPROCESSOR,
        {k: v for k, v in specials.items() if k != "<|patch|>"},
        ("<|patch|>", IMAGE_TOKEN_ID),
        _LLAMA4_CHAT_TEMPLATE,
        "Llama4ImageProcessorFast",
    )
    return model
