"""The start-up summary states the memory the weights take beside the GGUF file's size."""

from __future__ import annotations

import msgspec
import pytest

from framework import LLM
from framework.engine.messages import Ready, TokenizerSpec
from framework.server.launcher import format_summary

pytestmark = pytest.mark.usefixtures("one_thread")


def test_summary_gives_packed_weight_memory_beside_the_file_size(smollm2_gguf_path, smollm2_gguf, monkeypatch):
    monkeypatch.setenv("FW_GGUF_KEEP_PACKED", "1")  # the CPU default dequantizes at load
    llm = LLM(str(smollm2_gguf_path), num_blocks=16)
    summary, config = llm.engine.summary, llm.engine.model_config
    # from the file: matrices at their packed size (the tied embedding once), norms as float32;
    # plus the rotary cos/sin table the model computes (fp32, max_model_len x head_dim)
    packed = sum(t.nbytes for t in smollm2_gguf.tensors.values() if len(t.shape) == 2)
    norms = sum(t.shape[0] * 4 for t in smollm2_gguf.tensors.values() if len(t.shape) == 1)
    rotary = config.max_model_len * config.head_size * 4
    assert summary["weight_bytes"] == packed + norms + rotary
    assert summary["checkpoint_bytes"] == smollm2_gguf_path.stat().st_size
    ready = Ready(
        summary=msgspec.json.decode(msgspec.json.encode(summary)),
        max_model_len=config.max_model_len,
        vocab_size=config.vocab_size,
        eos_token_ids=[],
        tokenizer=TokenizerSpec(tokenizer_json="{}"),
    )
    weights = f"{summary['weight_bytes'] / 2**30:.2f} GiB (file {smollm2_gguf_path.stat().st_size / 2**30:.2f} GiB)"
    assert f"  weights    {weights}" in format_summary(ready).splitlines()
    llm.close()
