"""The `gemma4` tokenizer model (Gemma 4 files) against transformers' ``GemmaTokenizer`` built from
the same vocabulary and merges, as llama.cpp's converter copies them from ``tokenizer.json``."""

from __future__ import annotations

from fw_gguf.tokenizer import tokenizer_from_gguf
from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]
PIECES = ["▁", "a", "b", "c", "▁a", "ab", "▁ab", "bc", "▁abc", "\n", "\n\n", "é", "▁é", "▁▁"]
MERGES = ["▁ a", "a b", "▁a b", "b c", "▁ab c", "\n \n", "▁ é", "▁ ▁"]
TEXTS = ["abc", " abc ab", "a  b\n\nc", "éa é", "x ab ☃ 😀", "<bos>ab<eos>", "  leading", "tab\tz"]


def gguf_metadata() -> dict:
    tokens = [*SPECIAL, *BYTES, *PIECES]
    return {
        "general.architecture": "gemma4",
        "tokenizer.ggml.model": "gemma4",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * len(tokens),
        "tokenizer.ggml.token_type": [3] * len(SPECIAL) + [6] * len(BYTES) + [1] * len(PIECES),
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.add_bos_token": True,
    }


def test_gemma4_tokenizer_matches_transformers_gemma_tokenizer():
    metadata = gguf_metadata()
    vocab = {t: i for i, t in enumerate(metadata["tokenizer.ggml.tokens"])}
    reference = GemmaTokenizer(vocab=vocab, merges=[tuple(m.split(" ")) for m in MERGES])
    ours = tokenizer_from_gguf(metadata)
    for text in TEXTS:
        expected = reference(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text, add_special_tokens=False).ids == expected, text
        assert ours.encode(text).ids == [2, *expected]  # the file's add_bos_token
        assert ours.decode(expected) == reference.decode(expected, skip_special_tokens=True), text
    assert ours.encode("▁ab", add_special_tokens=False).ids == [vocab["▁ab"]]
