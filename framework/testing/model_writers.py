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


def random_causal_lm(hf_config, seed: int = 0, *, randomise_norms_and_biases: bool = True):
    """A random-weight transformers causal LM of ``hf_config`` (fp32, eager attention, eval mode;
    torch seeded with ``seed``), with :func:`randomise_identity_params` applied unless
    ``randomise_norms_and_biases`` is false: the reference of a test that writes its own files."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    if randomise_norms_and_biases:
        randomise_identity_params(model)
    return model


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

    path = Path(path)
    model = random_causal_lm(hf_config, seed, randomise_norms_and_biases=randomise_norms_and_biases)
    model.save_pretrained(path, safe_serialization=True)
    make_tiny_tokenizer(hf_config.get_text_config().vocab_size).save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>"}
    if chat_template:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return model


def write_grouped_moe_model(path, hf_config, bias_std: float = 0.5):
    """A DeepSeek-V3-style MoE checkpoint (DeepSeek-V3, GLM-4.5, GLM-4.7-Flash) as released.

    :func:`write_randomised_model`, then every router's ``e_score_correction_bias`` drawn from
    ``N(0, bias_std)`` (transformers starts it at zero, where choosing by biased scores and
    weighting by unbiased ones cannot be told apart), and one multi-token-prediction layer
    appended after the decoder (``model.layers.{num_hidden_layers}.*``: the last layer's tensors
    plus ``eh_proj``, ``enorm``, ``hnorm`` and ``shared_head.head``), which a loader must skip.
    Returns the transformers reference (which has no MTP layer).
    """
    from pathlib import Path

    import torch
    from safetensors.torch import load_file, save_file

    path = Path(path)
    model = write_randomised_model(path, hf_config)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(bias_std * torch.randn(buffer.shape, generator=generator))
    model.save_pretrained(path, safe_serialization=True)
    tensors = load_file(path / "model.safetensors")
    last, extra = hf_config.num_hidden_layers - 1, hf_config.num_hidden_layers
    mtp = {
        name.replace(f"model.layers.{last}.", f"model.layers.{extra}."): tensor.clone()
        for name, tensor in tensors.items()
        if name.startswith(f"model.layers.{last}.")
    }
    hidden = hf_config.hidden_size
    mtp[f"model.layers.{extra}.eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=generator)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"model.layers.{extra}.{norm}.weight"] = torch.ones(hidden)
    mtp[f"model.layers.{extra}.shared_head.head.weight"] = torch.randn(
        hf_config.vocab_size, hidden, generator=generator
    )
    save_file({**tensors, **mtp}, path / "model.safetensors", metadata={"format": "pt"})
    return model
