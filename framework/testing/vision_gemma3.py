"""A tiny random Gemma 3 with images for tests (no download), written as
:mod:`framework.testing.vision` writes the other vision-language models: the word-level tokenizer's
ids are ``<s>`` 0, ``</s>`` 1, ``t2 .. t289`` and :data:`GEMMA3_SPECIALS`.
:func:`write_gemma3_tokenizer` swaps in a Gemma-shaped BPE tokenizer and Gemma 3's own chat
template, for prompts whose newlines must tokenize as transformers' ``Gemma3Processor`` does;
:func:`gemma3_inputs` gives transformers the inputs its processor would for fw's pixels."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from framework.testing.vision import IMAGE_TOKEN_ID, write_vision_checkpoint

#: Gemma 3's turn markers, image begin / end and image (soft) token; its template writes ``<start_of_image>``
GEMMA3_SPECIALS = {
    "<start_of_turn>": 290,
    "<end_of_turn>": 291,
    "<start_of_image>": 292,
    "<end_of_image>": 293,
    "<image_soft_token>": IMAGE_TOKEN_ID,
}
_GEMMA3_CHAT_TEMPLATE = (
    "<s> {% for m in messages %}<start_of_turn> {% if m.content is string %}{{ m.content }} {% else %}"
    "{% for p in m.content %}{% if p.type == 'image' %}<start_of_image> {% else %}{{ p.text }} {% endif %}"
    "{% endfor %}{% endif %}<end_of_turn> {% endfor %}{% if add_generation_prompt %}<start_of_turn> {% endif %}"
)
#: 56-pixel images: 8 x 8 patches of 7 pixels, pooled 2 x 2 into 16 image tokens
_TINY_GEMMA3_PREPROCESSOR = {
    "size": {"height": 56, "width": 56},
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "resample": 2,
    "rescale_factor": 1 / 255,
    "do_resize": True,
    "do_rescale": True,
    "do_normalize": True,
    "do_convert_rgb": None,
    "do_pan_and_scan": None,
}


def write_tiny_gemma3(path, seed: int = 0, layer_types: list[str] | None = None):
    """A random Gemma 3 with images (text: hidden 64, head_dim 16, sliding windows of 6 tokens,
    ``layer_types`` else a sliding layer then a global one; vision: SigLIP hidden 32, 2 blocks, 56-pixel images of 7-pixel
    patches; 16 image tokens per image, so each image's span is 18 tokens) written to ``path``.
    Returns the transformers model (fp32, eval, norms and the projection randomised)."""
    import torch
    import transformers

    from framework.testing.model_writers import randomise_identity_params

    path = Path(path)
    layer_types = layer_types or ["sliding_attention", "full_attention"]
    config = transformers.Gemma3Config(
        text_config=dict(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=len(layer_types),
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=512,
            query_pre_attn_scalar=16,
            sliding_window=6,
            layer_types=list(layer_types),
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=56,
            patch_size=7,
            vision_use_head=False,
        ),
        mm_tokens_per_image=16,
        image_token_index=IMAGE_TOKEN_ID,
        boi_token_index=GEMMA3_SPECIALS["<start_of_image>"],
        eoi_token_index=GEMMA3_SPECIALS["<end_of_image>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    randomise_identity_params(model)
    with torch.no_grad():  # initialised to zeros; scaled so image embeddings weigh like token embeddings
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.5)
        for layer in model.model.vision_tower.encoder.layers:  # sharper attention among patches
            layer.self_attn.q_proj.weight.mul_(4)
            layer.self_attn.k_proj.weight.mul_(4)
    specials = {k: v for k, v in GEMMA3_SPECIALS.items() if k != "<image_soft_token>"}
    image_token = ("<image_soft_token>", IMAGE_TOKEN_ID)
    write_vision_checkpoint(
        path, model, _TINY_GEMMA3_PREPROCESSOR, specials, image_token, _GEMMA3_CHAT_TEMPLATE, "Gemma3ImageProcessor"
    )
    return model


def gemma3_inputs(processor, ids: list[int], images) -> dict[str, Any]:
    """transformers' ``Gemma3ForConditionalGeneration`` inputs (a
    :class:`~framework.testing.vision_checks.VisionReference`'s) for ``ids`` (image tokens
    expanded) and ``images`` through fw's ``processor`` (a ``Gemma3ImageProcessor``): the stacked
    pixels and the ``token_type_ids`` its processor sends (1 on image tokens), which switch on its
    mask of bidirectional attention among an image's tokens."""
    import numpy as np
    import torch

    tensor = torch.tensor([ids])
    pixels = torch.from_numpy(np.stack([processor.preprocess(image).pixel_values for image in images]))
    return dict(input_ids=tensor, pixel_values=pixels, token_type_ids=(tensor == IMAGE_TOKEN_ID).long())


#: Gemma 3's own chat template (gemma-3-4b-it): a system message's text and a blank line open the
#: first user turn; text parts are trimmed; each image part is ``<start_of_image>``
GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""
#: the words :func:`write_gemma3_tokenizer` merges into one token each (beside runs of newlines)
_GEMMA3_WORDS = ("user", "model", "Look", "▁at", "▁this", "▁and", "▁image", "▁one", "Be", "▁brief.")


def write_gemma3_tokenizer(path) -> None:
    """Replace the word-level tokenizer of :func:`write_tiny_gemma3`'s checkpoint at ``path`` with
    one built as transformers' ``GemmaTokenizer`` builds Gemma's (BPE over "▁"-spelled text, the
    specials of :data:`GEMMA3_SPECIALS` at their ids, ``<bos>`` 0 and ``<eos>`` 1) and
    :data:`GEMMA3_CHAT_TEMPLATE`. Its vocabulary has single characters, runs of two to five
    newlines as one token each (as Gemma's has), and :data:`_GEMMA3_WORDS`; everything fits below
    the model's 300 ids. ``AutoTokenizer.from_pretrained(path)`` gives the tokenizer that
    ``transformers.Gemma3Processor`` takes (its image, begin and end of image tokens named)."""
    import string

    from transformers import GemmaTokenizer

    vocab = {"<bos>": 0, "<eos>": 1, "<pad>": 2, "<unk>": 3, "<mask>": 4}
    for ch in ["\n", "▁", *string.ascii_letters, *".,:;!?'<>_/-"]:
        vocab[ch] = len(vocab)
    merges: list[tuple[str, str]] = []

    def merge(left: str, right: str) -> None:
        vocab.setdefault(left + right, len(vocab))
        merges.append((left, right))

    for left, right in (("\n", "\n"), ("\n\n", "\n"), ("\n\n", "\n\n"), ("\n\n\n\n", "\n")):
        merge(left, right)
    for word in _GEMMA3_WORDS:
        for end in range(1, len(word)):
            if (word[:end], word[end]) not in merges:
                merge(word[:end], word[end])
    assert len(vocab) < min(GEMMA3_SPECIALS.values())
    tokenizer = GemmaTokenizer(
        vocab={**vocab, **GEMMA3_SPECIALS},
        merges=merges,
        extra_special_tokens={
            "image_token": "<image_soft_token>",
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
        },
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
