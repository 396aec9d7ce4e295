"""Tiny checkpoints for tests: a random Hugging Face model (safetensors, config, tokenizer) in a
directory, with its identity-initialised parameters randomised."""

from __future__ import annotations


def make_tiny_tokenizer(vocab_size: int):
    """A word-level ``tokenizers.Tokenizer`` with tokens ``t0 .. t{n-1}`` plus ``<s>``/``</s>``.

    Enough for tests of tiny random-weight models, which are driven by token ids.
    """
    import tokenizers
    from tokenizers import models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, **{f"t{i}": i for i in range(2, vocab_size)}}
    tokenizer = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = tokenizers.decoders.WordPiece(prefix="##")
    tokenizer.add_special_tokens(["<s>", "</s>"])
    return tokenizer


def randomise_identity_params(model, seed: int = 2) -> None:
    """Give ``model``'s norm weights (ones) and biases (zeros) random values, so that a misplaced
    norm or bias changes the outputs (``1 + 0.3 N(0, 1)`` and ``0.3 N(0, 1)``)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = 0.3 * torch.randn(param.shape, generator=generator)
            if "norm" in name and name.endswith(".weight"):
                param.copy_(1.0 + noise)
            elif name.endswith(".bias"):
                param.copy_(noise)


def write_randomised_model(path, hf_config):
    """:func:`write_tiny_model` with :func:`randomise_identity_params` applied before the one write;
    returns the reference."""
    return write_tiny_model(path, hf_config, randomise_norms_and_biases=True)


def write_tiny_model(
    path, hf_config, seed: int = 0, chat_template: str | None = None, *, randomise_norms_and_biases: bool = False
):
    """Write a random-weight transformers model of ``hf_config`` (a ``PretrainedConfig``) to ``path``.

    Saves safetensors weights, ``config.json``, a word-level ``tokenizer.json`` and
    ``tokenizer_config.json``; returns the transformers model (fp32, eval mode) as the reference.
    ``randomise_norms_and_biases`` applies :func:`randomise_identity_params` before saving.
    """
    import json
    from pathlib import Path

    import torch
    import transformers

    path = Path(path)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    if randomise_norms_and_biases:
        randomise_identity_params(model)
    model.save_pretrained(path, safe_serialization=True)
    make_tiny_tokenizer(hf_config.get_text_config().vocab_size).save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>"}
    if chat_template:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return model
