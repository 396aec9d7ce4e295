"""The real GGUF models on the CPU with their weights kept packed (fw_gguf.cpu's kernels) against
the same engine with every weight dequantized to fp32 at load (``FW_GGUF_CPU_PACKED=0``): the
file's bytes and nothing else in memory, logits equal up to fp32 summation order, the same
greedy tokens."""

from __future__ import annotations

import pytest
import torch

from framework import LLM, SamplingParams
from framework.testing import capture_logits

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,"]
STEPS = 16


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's weights: its parameters and the GGUF layers' buffers (not computed
    buffers such as rotary tables), each storage counted once (a tied head shares the table)."""
    seen, total = set(), 0
    gguf_buffers = [t for name, t in model.named_buffers() if name.rpartition(".")[2].startswith("gguf_")]
    for tensor in [*model.parameters(), *gguf_buffers]:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def run(path, monkeypatch, packed: str):
    monkeypatch.setenv("FW_GGUF_CPU_PACKED", packed)
    llm = LLM(str(path), num_blocks=32)
    records = capture_logits(llm)
    # the three prompts prefill in one step (more rows than the kernels' direct path takes), then decode
    results = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True))
    logits = torch.stack([records[key] for key in sorted(records, key=lambda k: (str(k[0]), k[1]))])
    return llm, logits, [r.outputs[0].token_ids for r in results]


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_packed_cpu_path_equals_dequantize_at_load(which, request, monkeypatch, check_kept_packed):
    path = request.getfixturevalue(f"{which}_gguf_path")
    dense_llm, dense_logits, dense_tokens = run(path, monkeypatch, "0")
    dense_bytes = weight_bytes(dense_llm.engine.core.runner.model)
    del dense_llm
    llm, logits, tokens = run(path, monkeypatch, "1")
    model = llm.engine.core.runner.model
    assert llm.engine.attention_backend == "torch_sdpa"  # the CPU's batched decode attention
    packed = check_kept_packed(model)
    assert all(model.get_submodule(name).gguf_cpu_kernels for name in packed)
    file_bytes = path.stat().st_size
    assert weight_bytes(model) <= 1.2 * file_bytes < dense_bytes
    assert tokens == dense_tokens and all(len(ids) == STEPS for ids in tokens)
    scale = dense_logits.abs().max().item()
    torch.testing.assert_close(logits, dense_logits, rtol=0, atol=2e-4 * scale)
