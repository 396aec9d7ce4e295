"""fw_gguf.tokenizer against transformers' GGUF tokenizers, on the two real models."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from fw_gguf.tokenizer import chat_template, special_token_ids, stop_token_ids, tokenizer_from_gguf
from tokenizers import Tokenizer

BASE = [
    "Hello world",
    "Hello, world!",
    " leading space",
    "trailing space ",
    "  two leading spaces",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll've done it; we'd, you're, it's.",
    "UPPER lower MiXeD CamelCase snake_case kebab-case",
    "e-mail: someone@example.com, https://example.org/a?b=c&d=e#f",
    "def add(a, b):\n    return a + b\n",
    "for (int i = 0; i < n; ++i) { sum += x[i]; }",
    "if x == 3:\n\tprint('tab')\n",
    '<div class="x">&nbsp;</div>',
    "SELECT * FROM t WHERE id IN (1, 2, 3);",
    "λx. x + 1 → ∀y ∈ ℝ: y² ≥ 0",
    "你好，世界！",
    "日本語のテキストです。カタカナ、ひらがな、漢字。",
    "한국어 문장입니다.",
    "混合 mixed 文本 text 123",
    "emoji 😀😃😄 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️",
    "🤖🚀✨",
    "Ünïcödé àccênts: café, naïve, façade, coöperate, São Paulo, Ærøskøbing",
    "Ελληνικά κείμενο",
    "Русский текст, ещё один.",
    "العربية نص",
    "עברית",
    "हिन्दी पाठ",
    "ไทย",
    "numbers 0 1 12 123 1234 12345 3.14159 -42 1e-9 0x1F 1,000,000",
    "2024-01-31T12:34:56Z",
    "$19.99 €5 £3 ¥100",
    "   ",
    "\t",
    "\n",
    "\n\n",
    "\r\n",
    " \t \n \t\t  \n\n\n   x",
    "a\u00a0b\u2009c\u3000d",
    "tabs\tin\tbetween",
    "line1\nline2\r\nline3\rline4",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "<bos><eos><pad><unk>",
    "<|endoftext|>",
    "<s></s>",
    "<|im_start|",
    "im_start|>",
    "<start_of_turn",
    "[multimodal]",
    "<mask>",
    "<0x41> literal byte token text",
    "\u2581 literal metaspace",
    "zero\u200bwidth",
    "control\x00\x01\x07chars",
    "a" * 50,
    "ab" * 40,
    "!!!???...,,,;;;",
    "--==__++",
    "``` python\nprint(1)\n```",
    "  indented\n    more\n\tmixed  \t",
]


def _corpus() -> list[str]:
    rng = random.Random(1234)
    pieces = [
        "abc",
        "XYZ",
        "012",
        "\t",
        "\n\n",
        "  ",
        "éü",
        "你好",
        "😀",
        "<|im_end|>",
        "<end_of_turn>",
        "\u2581",
        "'",
        ",",
        ".",
        "-",
        " ",
        "\n",
    ]
    texts = list(BASE)
    texts += [" " + s for s in BASE[:40]] + [s + "\n" for s in BASE[:40]]
    texts += [s + " " + t for s, t in zip(BASE[::2], BASE[1::2], strict=False)]
    texts += ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 25))) for _ in range(60)]
    return texts


CORPUS = _corpus()


@pytest.fixture(scope="module")
def tokenizer_pair(real_gguf, fw_tokenizer, hf_reference):
    return fw_tokenizer(real_gguf), hf_reference(real_gguf.path)[0]


def test_corpus_is_large_enough():
    assert len(CORPUS) >= 200


def test_encode_matches_transformers(tokenizer_pair):
    ours, reference = tokenizer_pair
    for add_special_tokens in (True, False):
        expected = [reference.encode(t, add_special_tokens=add_special_tokens) for t in CORPUS]
        got = [e.ids for e in ours.encode_batch(CORPUS, add_special_tokens=add_special_tokens)]
        mismatches = [(t, e, g) for t, e, g in zip(CORPUS, expected, got, strict=True) if e != g]
        assert not mismatches, mismatches[:3]


def test_decode_matches_transformers_and_round_trips(tokenizer_pair):
    ours, reference = tokenizer_pair
    for text in CORPUS:
        ids = reference.encode(text)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip), text
        # SentencePiece spells spaces "▁", so a literal "▁" comes back as a space
        if "\u2581" not in text:
            plain = ours.encode(text, add_special_tokens=False).ids
            assert ours.decode(plain, skip_special_tokens=False) == text


def _structure(tok: Tokenizer, folder: Path) -> dict:
    """Everything that decides ids and text: the pipeline components, the BPE model's options,
    vocab.json and merges.txt as the model writes them, and the added tokens."""
    folder.mkdir()
    state = {
        part: getattr(tok, part).__getstate__()
        for part in ("normalizer", "pre_tokenizer", "post_processor", "decoder")
        if getattr(tok, part)
    }
    options = (
        "byte_fallback",
        "unk_token",
        "fuse_unk",
        "continuing_subword_prefix",
        "end_of_word_suffix",
        "dropout",
        "ignore_merges",
    )
    state["model"] = {option: getattr(tok.model, option) for option in options}
    state["files"] = [Path(f).read_bytes() for f in tok.model.save(str(folder))]
    state["added"] = sorted((i, t.content, t.special, t.normalized) for i, t in tok.get_added_tokens_decoder().items())
    return state


def test_tokenizer_structure_matches_transformers(tokenizer_pair, tmp_path):
    ours, reference = tokenizer_pair
    # vocab, merges (rebuilt from the vocabulary for Gemma), normalizer, pre-tokenizer, decoder, template
    assert _structure(ours, tmp_path / "ours") == _structure(reference.backend_tokenizer, tmp_path / "reference")


def test_special_tokens_of_smollm2(smollm2_gguf, fw_tokenizer):
    md = smollm2_gguf.metadata
    tok = fw_tokenizer(smollm2_gguf)
    assert special_token_ids(md) == {"bos": 1, "eos": 2, "eot": None, "pad": 2, "unk": 0}
    assert stop_token_ids(md) == [0, 2]  # <|im_end|> and <|endoftext|>
    assert tok.encode("<|im_start|>user\nHi<|im_end|>").ids[:1] == [1]  # no bos added, markers kept whole
    assert tok.encode("<|im_end|>").ids == [2] and tok.decode([1, 2], skip_special_tokens=True) == ""
    template = chat_template(md)
    assert template.startswith("{% for message in messages %}") and "<|im_start|>" in template


def test_special_tokens_of_gemma3(gemma3_gguf, fw_tokenizer):
    md = gemma3_gguf.metadata
    tok = fw_tokenizer(gemma3_gguf)
    assert special_token_ids(md) == {"bos": 2, "eos": 1, "eot": None, "pad": 0, "unk": 3}
    end_of_turn = md["tokenizer.ggml.tokens"].index("<end_of_turn>")
    assert stop_token_ids(md) == [1, end_of_turn]
    ids = tok.encode("<start_of_turn>user\nHi<end_of_turn>").ids
    assert ids[0] == 2 and ids[-1] == end_of_turn  # bos added (add_bos_token), markers kept whole
    assert tok.encode("Hi", add_special_tokens=False).ids == ids[-2:-1]
    assert tok.decode(tok.encode("a\tb").ids, skip_special_tokens=True) == "a\tb"
    assert chat_template(md) is None  # a base model


def test_unsupported_tokenizer_model_is_named():
    with pytest.raises(
        ValueError, match="tokenizer model 'rwkv' is not supported by fw; supported: gpt2, llama, gemma4"
    ):
        tokenizer_from_gguf({"tokenizer.ggml.model": "rwkv", "tokenizer.ggml.tokens": []})
