"""Build a `tokenizers.Tokenizer` from GGUF `tokenizer.ggml.*` metadata.

The result matches the tokenizer transformers builds from the same file
(`AutoTokenizer.from_pretrained(dir, gguf_file=...)`, see transformers'
`integrations/gguf/gguf_tokenizer_mapping.py`), id for id:

* `gpt2` (byte-level BPE): tokens respelled into the GPT-2 byte alphabet, the file's merges, a
  ByteLevel pre-tokenizer, or a regex split first for the `tokenizer.ggml.pre` values below.
* `llama` (SentencePiece BPE with `<0xNN>` byte fallback): merges rebuilt from the vocabulary,
  ranked by token score; Gemma ranks by vocabulary position instead, spells whitespace-only tokens
  with `▁`, and replaces spaces in a normalizer rather than prepending `▁`.

CONTROL tokens become special added tokens and USER_DEFINED ones plain added tokens (matched
whole, not skipped when decoding), as in transformers and llama.cpp.
"""

from __future__ import annotations

import functools
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-4o's (o200k) split, which Llama 4's tokenizer.json uses (llama.cpp: pre "llama4" / "gpt-4o")
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# `tokenizer.ggml.pre` -> split regex applied before the byte-level mapping. Absent values
# (gpt2, smollm, default, ...) use ByteLevel's own GPT-2 regex. SmolLM's vocabulary has no merge
# touching a digit, so llama.cpp's per-digit split for `smollm` gives the same ids.
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "stablelm2": _QWEN2_SPLIT,
    "glm4": _LLAMA3_SPLIT,  # llama.cpp's CHATGLM4 pre-tokenizer: the Llama 3 regex
    "chatglm-bpe": _LLAMA3_SPLIT,
    "gpt-4o": _GPT4O_SPLIT,
    "llama4": _GPT4O_SPLIT,
}


def chat_template(metadata: dict[str, Any]) -> str | None:
    """The Jinja chat template stored in `tokenizer.chat_template`, or None (base models)."""
    return metadata.get("tokenizer.chat_template")


def special_token_ids(metadata: dict[str, Any]) -> dict[str, int | None]:
    """Ids of the bos, eos, eot (end of turn), pad and unk tokens the file names; None if absent."""
    keys = {"bos": "bos", "eos": "eos", "eot": "eot", "pad": "padding", "unk": "unknown"}
    return {name: metadata.get(f"tokenizer.ggml.{key}_token_id") for name, key in keys.items()}


# Texts llama.cpp (llama-vocab.cpp) treats as end of generation wherever they are in the vocabulary.
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
        "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
        "<|return|>", "<|call|>",
    }
)  # fmt: skip


def stop_token_ids(metadata: dict[str, Any]) -> list[int]:
    """Token ids that end generation, collected the way llama.cpp does: the eos, eot and eom ids the
    file names, plus every token spelled like a known end-of-turn marker (`<end_of_turn>`,
    `<|im_end|>`, ...), which llama.cpp matches by text even where the file lacks an eot id."""
    ids = {metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")}
    ids.update(i for i, t in enumerate(metadata.get("tokenizer.ggml.tokens") or ()) if t in _EOG_TEXTS)
    return sorted(i for i in ids if i is not None)


@functools.cache
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def _merges_from_vocab(tokens: list[str], ranks: list[float]) -> list[tuple[str, str]]:
    """Every split of a token into two vocabulary tokens, best rank first.

    Same order as transformers' `generate_merges`: tokens by rank (descending, stable), and within
    a token longer left parts first. Duplicated tokens keep their last id and last rank.
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    rank = dict(zip(tokens, ranks, strict=True))
    merges = []
    for piece, score in rank.items():
        size = len(piece)
        merges += [
            (score, cut, size - cut, piece[:cut], piece[cut:])
            for cut in range(size - 1, 0, -1)
            if piece[:cut] in vocab and piece[cut:] in vocab
        ]
    merges.sort(key=lambda m: m[:3], reverse=True)
    return [(m[3], m[4]) for m in merges]


def _byte_level(metadata: dict[str, Any]) -> Tokenizer:
    spelling = _byte_to_unicode()
    alphabet = set(spelling.values())
    tokens = [
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))
        for t in metadata["tokenizer.ggml.tokens"]
    ]
    merges = [tuple(m.split(" ")) for m in metadata["tokenizer.ggml.merges"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(
        BPE(vocab, merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    )
    split = PRE_TOKENIZER_SPLITS.get(metadata.get("tokenizer.ggml.pre", ""))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(metadata: dict[str, Any]) -> Tokenizer:
    arch = metadata.get("general.architecture", "")
    tokens = list(metadata["tokenizer.ggml.tokens"])
    is_gemma = arch in ("gemma", "gemma2", "gemma3")
    if is_gemma:
        # whitespace-only tokens are stored with real spaces, looked up as "▁" runs
        tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
        ranks = [-i for i in range(len(tokens))]  # Gemma's merge order is vocabulary order
    else:
        ranks = metadata["tokenizer.ggml.scores"]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = _merges_from_vocab(tokens, ranks)
    replace_then_bytes = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if is_gemma:
        return _gemma_bpe(metadata, vocab, merges)
    tok = Tokenizer(BPE(vocab, merges, fuse_unk=True, byte_fallback=True, dropout=None))
    if arch == "phi3":  # the prefix "▁" comes from a normalizer, so leading spaces are kept as is
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([*replace_then_bytes, decoders.Strip(" ", 1, 0)])
    return tok


def _gemma_bpe(metadata: dict[str, Any], vocab: dict[str, int], merges: list[tuple[str, str]]) -> Tokenizer:
    """Gemma's BPE: spaces spelled "▁" by the normalizer (transformers' GemmaTokenizer), bytes as ``<0xXX>`` fallback tokens."""
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk = metadata["tokenizer.ggml.tokens"][unk_id] if unk_id is not None else "<unk>"
    tok = Tokenizer(BPE(vocab, merges, fuse_unk=True, unk_token=unk, dropout=None, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


def _gemma4(metadata: dict[str, Any]) -> Tokenizer:
    """Gemma 4 (`tokenizer.ggml.model` "gemma4"): Gemma's BPE with the file's own merges (llama.cpp's
    converter copies the vocabulary and merges of the model's ``tokenizer.json`` as they are; a
    merge splits at its first space after the first character, as llama.cpp reads it)."""
    tokens = list(metadata["tokenizer.ggml.tokens"])
    merges = [(m[: m.index(" ", 1)], m[m.index(" ", 1) + 1 :]) for m in metadata["tokenizer.ggml.merges"]]
    return _gemma_bpe(metadata, {t: i for i, t in enumerate(tokens)}, merges)


_MODELS = {"gpt2": _byte_level, "llama": _sentencepiece, "gemma4": _gemma4}


def _add_special_tokens(tok: Tokenizer, metadata: dict[str, Any]) -> None:
    tokens = metadata["tokenizer.ggml.tokens"]
    types = metadata.get("tokenizer.ggml.token_type") or []
    byte_level = metadata["tokenizer.ggml.model"] == "gpt2"
    alphabet = set(_byte_to_unicode().values())
    # a byte-level CONTROL token outside the byte alphabet is a llama.cpp mislabel (as transformers)
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, kind in zip(tokens, types, strict=False)  # token types may be absent
        if kind == _CONTROL and (not byte_level or set(t) <= alphabet)
    ]
    tok.add_special_tokens(control)
    vocab = tok.get_vocab()
    tok.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, types, strict=False)
            if kind == _USER_DEFINED and t in vocab
        ]
    )
    named = [metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown", "padding")]
    tok.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True) for i in named if i is not None])


def _post_processor(metadata: dict[str, Any]) -> processors.TemplateProcessing:
    """`[bos] $A [eos]` (pair: `[bos] $A [eos] [bos] $B [eos]`) per the file's add_bos/add_eos."""
    tokens = metadata["tokenizer.ggml.tokens"]
    added = {}
    for name, default in (("bos", metadata["tokenizer.ggml.model"] == "llama"), ("eos", False)):
        token_id = metadata.get(f"tokenizer.ggml.{name}_token_id")
        if token_id is not None and metadata.get(f"tokenizer.ggml.add_{name}_token", default):
            added[name] = (tokens[token_id], token_id)

    def sequence(name: str, type_id: int) -> list[str]:
        bos = [f"{added['bos'][0]}:{type_id}"] if "bos" in added else []
        eos = [f"{added['eos'][0]}:{type_id}"] if "eos" in added else []
        return [*bos, f"${name}:{type_id}", *eos]

    return processors.TemplateProcessing(
        single=sequence("A", 0), pair=sequence("A", 0) + sequence("B", 1), special_tokens=list(added.values())
    )


def tokenizer_from_gguf(metadata: dict[str, Any]) -> Tokenizer:
    """A `tokenizers.Tokenizer` equivalent to transformers' tokenizer for this GGUF.

    Handles `tokenizer.ggml.model` `gpt2`, `llama` and `gemma4`; raises `ValueError` naming the model and
    the supported ones otherwise. `encode(text)` adds bos/eos per `tokenizer.ggml.add_bos_token` /
    `add_eos_token` (bos defaults to on for `llama`, off for `gpt2`); `encode(text,
    add_special_tokens=False)` adds neither. Special-token text in the input ("<|im_start|>")
    maps to its single id.
    """
    model = metadata.get("tokenizer.ggml.model")
    if model not in _MODELS:
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported by fw; supported: {', '.join(_MODELS)}")
    tok = _MODELS[model](metadata)
    _add_special_tokens(tok, metadata)
    tok.post_processor = _post_processor(metadata)
    return tok
