"""Test helpers for fw and for plugin authors (a pytest plugin: ``pytest_plugins = ["framework.testing"]``).

Fixtures:

* ``register_fw_plugin``: ``register_fw_plugin(obj, name="x")`` registers a plugin object (a
  module or any object with ``@hookimpl`` methods) for the current test only.
* ``fresh_plugins``: forget loaded plugins before and after the test, so a test can set
  ``FW_PLUGINS`` / ``FW_DISABLE_PLUGINS`` with ``monkeypatch`` and load again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from framework import plugins


@contextlib.contextmanager
def registered_plugin(obj: Any, name: str) -> Iterator[Any]:
    """Register ``obj`` as plugin ``name`` for the duration of the ``with`` block."""
    plugins.register_plugin(obj, name)
    try:
        yield obj
    finally:
        plugins.unregister_plugin(name)


@pytest.fixture
def register_fw_plugin():
    """Register plugin objects for one test: ``register_fw_plugin(obj, name="mine")``."""
    with contextlib.ExitStack() as stack:
        yield lambda obj, name="test_plugin": stack.enter_context(registered_plugin(obj, name))


@pytest.fixture
def fresh_plugins():
    """Reset plugin discovery before and after the test (environment changes take effect)."""
    plugins.reset_plugins()
    yield plugins
    plugins.reset_plugins()


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


def write_tiny_model(path, hf_config, seed: int = 0, chat_template: str | None = None):
    """Write a random-weight transformers model of ``hf_config`` (a ``PretrainedConfig``) to ``path``.

    Saves safetensors weights, ``config.json``, a word-level ``tokenizer.json`` and
    ``tokenizer_config.json``; returns the transformers model (fp32, eval mode) as the reference.
    """
    import json
    from pathlib import Path

    import torch
    import transformers

    path = Path(path)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    make_tiny_tokenizer(hf_config.vocab_size).save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>"}
    if chat_template:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return model
