"""Tiny vision-language checkpoints and images for tests (no download): a random Qwen2.5-VL,
Qwen3-VL (dense or MoE), Qwen3.5 (dense or MoE), Mistral 3, Llama 4 or Gemma 3 with a word-level
tokenizer, a chat template of the family's shape and a ``preprocessor_config.json``.

The tokenizer's ids: ``<s>`` 0, ``</s>`` 1, ``t2 .. t289`` and the specials of :data:`VISION_SPECIALS`
(Mistral 3: of :data:`MISTRAL3_SPECIALS`; Llama 4 and Gemma 3: those of
:mod:`framework.testing.vision_llama4` and :mod:`framework.testing.vision_gemma3`).
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

VISION_SPECIALS = {"<|im_start|>": 290, "<|im_end|>": 291, "<|vision_start|>": 292, "<|vision_end|>": 293}
IMAGE_TOKEN, IMAGE_TOKEN_ID = "<|image_pad|>", 294
#: renders an image part as Qwen2-VL's templates do: vision start, one image token, vision end
VISION_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }} {% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{% if p.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ p.text }}{% endif %}{% endfor %}{% endif %}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)
#: pixel bounds that keep tiny test images tiny: 56x56 (4 image tokens) up to 28*28*64 (64 tokens)
TINY_PREPROCESSOR = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 64, "patch_size": 14, "merge_size": 2}
#: Qwen3-VL's 16-pixel patches: 64x64 (4 image tokens) up to 32*32*64 (64 tokens), its 0.5 statistics
_TINY_QWEN3_PREPROCESSOR = {
    "min_pixels": 64 * 64,
    "max_pixels": 32 * 32 * 64,
    "patch_size": 16,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}

#: Qwen3-VL's tower, small: hidden 32, 16-pixel patches merged 2x2, a 4x4 learned position grid
_TINY_QWEN3_TOWER = dict(
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=64,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=16,
)

#: Mistral 3's image token and layout tokens (its template writes ``[IMG]`` once per image)
MISTRAL3_SPECIALS = {"[INST]": 290, "[/INST]": 291, "[IMG_BREAK]": 292, "[IMG_END]": 293, "[IMG]": IMAGE_TOKEN_ID}
_MISTRAL3_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'user' %}[INST] {% if m.content is string %}{{ m.content }}"
    "{% else %}{% for p in m.content %}{% if p.type == 'image' %}[IMG] {% else %}{{ p.text }} {% endif %}"
    "{% endfor %}{% endif %}[/INST] {% else %}{{ m.content }} </s> {% endif %}{% endfor %}"
)
#: Pixtral resizes so the longest side is at most 112 pixels: up to 4 x 4 merged 28-pixel blocks
_TINY_MISTRAL3_PREPROCESSOR = {"size": {"longest_edge": 112}, "patch_size": {"height": 14, "width": 14}}


def write_tiny_mistral3(path, seed: int = 0):
    """A random Mistral 3 (text: Mistral, hidden 64, 2 layers, head_dim 16; vision: Pixtral, hidden
    32, 2 blocks, 14-pixel patches, 2x2 merge; ``vision_feature_layer`` -1) written to ``path``;
    its config names ``[IMG_BREAK]`` and ``[IMG_END]`` (``image_break_token_id``,
    ``image_end_token_id``; released configs do not, and fw takes the tekken tokenizer's ids).
    Returns the transformers model (fp32, eval, norms randomised, the tower's query and key
    weights scaled up)."""
    import torch
    import transformers

    from framework.testing.model_writers import randomise_identity_params

    path = Path(path)
    config = transformers.Mistral3Config(
        text_config=dict(
            model_type="mistral",
            vocab_size=300,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=512,
            sliding_window=None,
            bos_token_id=0,
            eos_token_id=1,
        ),
        vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, patch_size=14
        ),
        image_token_index=IMAGE_TOKEN_ID,
        spatial_merge_size=2,
        tie_word_embeddings=False,
    )
    config.image_break_token_id = MISTRAL3_SPECIALS["[IMG_BREAK]"]
    config.image_end_token_id = MISTRAL3_SPECIALS["[IMG_END]"]
    torch.manual_seed(seed)
    model = transformers.Mistral3ForConditionalGeneration(config).eval()
    randomise_identity_params(model)
    with torch.no_grad():  # sharper attention over patches, so the tower's 2-D rotary matters to its output
        for layer in model.model.vision_tower.transformer.layers:
            layer.attention.q_proj.weight.mul_(12)
            layer.attention.k_proj.weight.mul_(12)
    specials = {k: v for k, v in MISTRAL3_SPECIALS.items() if k != "[IMG]"}
    image_token = ("[IMG]", IMAGE_TOKEN_ID)
    write_vision_checkpoint(
        path,
        model,
        _TINY_MISTRAL3_PREPROCESSOR,
        specials,
        image_token,
        _MISTRAL3_CHAT_TEMPLATE,
        "PixtralImageProcessor",
    )
    return model


def write_tiny_qwen2_5_vl(path, seed: int = 0, window_size: int = 56):
    """A random Qwen2.5-VL (text: hidden 64, 2 layers, M-RoPE sections [2, 3, 3]; vision: hidden 32,
    2 blocks, the second with full attention, windows of ``window_size`` pixels: 2x2 merged blocks;
    112, the released checkpoints' and llama.cpp's, 4x4) written to ``path``; returns the
    transformers model (fp32, eval mode, norms and biases randomised) as the reference."""
    import transformers

    return _write_qwen_vl(
        Path(path),
        (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration),
        seed,
        TINY_PREPROCESSOR,
        text_config=dict(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
            bos_token_id=0,
            eos_token_id=1,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=window_size,
            fullatt_block_indexes=[1],
        ),
    )


def write_tiny_qwen3_vl(path, seed: int = 0, moe: bool = False):
    """A random Qwen3-VL (text: Qwen3, hidden 64, 2 layers, head_dim 16, interleaved M-RoPE sections
    [2, 3, 3]; with ``moe`` Qwen3-MoE, 4 experts of width 48, top 2; vision: hidden 32, 3 blocks,
    16-pixel patches, a 4x4 learned position grid, DeepStack from blocks 0 and 1) written to
    ``path``; returns the transformers model (fp32, eval mode, norms and biases randomised)."""
    import transformers

    path = Path(path)
    text = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True},
        bos_token_id=0,
        eos_token_id=1,
    )
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, decoder_sparse_step=1)
    vision = dict(_TINY_QWEN3_TOWER, depth=3, deepstack_visual_indexes=[0, 1])
    classes = (
        (transformers.Qwen3VLMoeConfig, transformers.Qwen3VLMoeForConditionalGeneration)
        if moe
        else (transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration)
    )
    return _write_qwen_vl(path, classes, seed, _TINY_QWEN3_PREPROCESSOR, text_config=text, vision_config=vision)


def write_tiny_qwen3_5_vl(path, seed: int = 0, moe: bool = False):
    """A random Qwen3.5 (text: the hybrid decoder, hidden 64, layers DeltaNet / gated attention /
    DeltaNet, head_dim 32 with 8 rotated features, interleaved M-RoPE sections [2, 1, 1] over
    rope_theta 100 so that positions move the logits; with ``moe`` Qwen3.5-MoE, 4 experts of
    width 32, top 2, a shared expert; vision: Qwen3-VL's tower without DeepStack, hidden 32, 2
    blocks, 16-pixel patches, a 4x4 learned position grid) written to ``path``; returns the
    transformers ``Qwen3_5(Moe)ForConditionalGeneration`` (fp32, eval mode, norms and biases randomised)."""
    import transformers

    path = Path(path)
    text = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        max_position_embeddings=512,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 100.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        bos_token_id=0,
        eos_token_id=1,
    )
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=40)
    classes = (
        (transformers.Qwen3_5MoeConfig, transformers.Qwen3_5MoeForConditionalGeneration)
        if moe
        else (transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration)
    )
    vision = dict(_TINY_QWEN3_TOWER, depth=2)
    return _write_qwen_vl(
        path, classes, seed, _TINY_QWEN3_PREPROCESSOR, text_config=text, vision_config=vision, tie_word_embeddings=False
    )


def _write_qwen_vl(path: Path, classes: tuple, seed: int, preprocessor: dict, **config):
    """A random model of ``classes`` (config class, model class; ``config`` its keywords, with the
    Qwen-VL ids of :data:`VISION_SPECIALS`), fp32, eval mode, norms and biases randomised,
    written to ``path`` with ``preprocessor``; returns it."""
    import torch

    from framework.testing.model_writers import randomise_identity_params

    config_class, model_class = classes
    config = config_class(
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=IMAGE_TOKEN_ID + 1,
        vision_start_token_id=VISION_SPECIALS["<|vision_start|>"],
        vision_end_token_id=VISION_SPECIALS["<|vision_end|>"],
        **config,
    )
    torch.manual_seed(seed)
    model = model_class(config).eval()
    randomise_identity_params(model)
    write_vision_checkpoint(path, model, preprocessor)
    return model


def write_vision_checkpoint(
    path: Path,
    model,
    preprocessor: dict,
    vision_specials: dict[str, int] = VISION_SPECIALS,
    image_token: tuple[str, int] = (IMAGE_TOKEN, IMAGE_TOKEN_ID),
    chat_template: str = VISION_CHAT_TEMPLATE,
    processor_type: str = "Qwen2VLImageProcessor",
) -> None:
    """``model``'s weights and config, the word-level tokenizer (``vision_specials`` and the
    ``image_token`` beside the words), ``chat_template`` and ``preprocessor``."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    model.save_pretrained(path, safe_serialization=True)
    specials = {**vision_specials, image_token[0]: image_token[1]}
    vocab = {"<s>": 0, "</s>": 1, **{f"t{i}": i for i in range(2, 290)}, **specials}
    tokenizer = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<s>", "</s>", *specials])
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "chat_template": chat_template})
    )
    (path / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": processor_type, **preprocessor}))


def random_image(width: int, height: int, seed: int):
    """An RGB ``PIL.Image`` of uniform random pixels."""
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def data_url(image, image_format: str = "PNG") -> str:
    """``image`` as a ``data:image/...;base64,`` URL."""
    buffer = io.BytesIO()
    image.save(buffer, format=image_format)
    return f"data:image/{image_format.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()
