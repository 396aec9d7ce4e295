"""Tokenization, chat templates and incremental detokenization on top of ``tokenizers``.

A :class:`Tokenizer` wraps a ``tokenizers.Tokenizer`` (from ``tokenizer.json`` or built by a
weight-format plugin from GGUF metadata) with the special tokens and the chat template, and
renders templates with jinja2 the way transformers does (sandboxed, ``trim_blocks``,
``lstrip_blocks``, ``raise_exception``, ``strftime_now``, ``tojson``).
"""

from __future__ import annotations

import datetime
import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers.decoders import DecodeStream

from framework.errors import ConfigError, ModelLoadError


@dataclass(slots=True)
class Tokenizer:
    """Text <-> token ids for one model, plus its chat template and special tokens."""

    backend: tokenizers.Tokenizer
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    extra_eos_token_ids: frozenset[int] = frozenset()
    template_vars: dict[str, Any] = field(default_factory=dict)
    _compiled: Any = None
    _literal: Any = None  # a copy of ``backend`` that reads special-token text as plain text
    _special_pattern: Any = None

    @classmethod
    def from_directory(cls, path: Path) -> Tokenizer:
        """Load ``tokenizer.json``, ``tokenizer_config.json`` and the chat template from ``path``."""
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.exists():
            raise ModelLoadError(f"{path} has no tokenizer.json (fw reads the fast-tokenizer format)")
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        config = _read_json(path / "tokenizer_config.json")
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {item["name"]: item["template"] for item in template}
            template = named.get("default") or next(iter(named.values()), None)
        if (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        elif (path / "chat_template.json").exists():
            template = _read_json(path / "chat_template.json").get("chat_template", template)
        return cls(
            backend,
            template,
            _token_text(config.get("bos_token")),
            _token_text(config.get("eos_token")),
            _token_text(config.get("pad_token")),
        )

    # --- ids -----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.eos_token)

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset(
            self.backend.token_to_id(t.content) for t in self.backend.get_added_tokens_decoder().values() if t.special
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenize ``text``; special-token text in it (``<|im_end|>``) becomes that control token."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_literal(self, text: str) -> list[int]:
        """Tokenize ``text`` as plain text: special-token text in it is spelled out, never a control
        token (no BOS/EOS are added either)."""
        if self._literal is None:
            literal = tokenizers.Tokenizer.from_str(self.backend.to_str())
            literal.encode_special_tokens = True
            self._literal = literal
        return self._literal.encode(text, add_special_tokens=False).ids

    def special_text_pattern(self) -> Any:
        """A compiled regex matching the text of any special token (longest first); None without any."""
        if self._special_pattern is None:
            texts = sorted(
                {t.content for t in self.backend.get_added_tokens_decoder().values() if t.special and t.content},
                key=len,
                reverse=True,
            )
            self._special_pattern = re.compile("|".join(map(re.escape, texts))) if texts else False
        return self._special_pattern or None

    def find_special_text(self, text: str) -> str | None:
        """The first special token's text found in ``text``, or None."""
        pattern = self.special_text_pattern()
        found = pattern.search(text) if pattern is not None else None
        return found.group() if found else None

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """A streaming decoder for one sequence of generated ids."""
        return IncrementalDetokenizer(self, skip_special_tokens)

    # --- chat ----------------------------------------------------------------------------
    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` with the model's template; raises ConfigError if it has none."""
        if not self.chat_template:
            raise ConfigError("this model has no chat template; use the completions API with a plain prompt")
        if self._compiled is None:
            self._compiled = compile_chat_template(self.chat_template)
        variables = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "pad_token": self.pad_token or "",
            **self.template_vars,
            **kwargs,
        }
        return self._compiled.render(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **variables
        )

    def encode_chat(self, messages: list[dict], **kwargs: Any) -> list[int]:
        """Template then tokenize; the template writes its own special tokens (BOS included)."""
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns generated ids into text pieces, holding back incomplete UTF-8 (byte-fallback tokens)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.text = ""

    def step(self, token_id: int) -> str:
        """Feed one id; return the new text it completes (possibly empty)."""
        piece = self.stream.step(self.tokenizer.backend, token_id) or ""
        self.text += piece
        return piece


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def _token_text(token: Any) -> str | None:
    if isinstance(token, dict):
        return token.get("content")
    return token


def compile_chat_template(text: str) -> Any:
    """``text`` as a template of the sandboxed chat-template environment; jinja2 errors for bad syntax."""
    return _jinja_env().from_string(text)


def _jinja_env():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False
    ) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env
