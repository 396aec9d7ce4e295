"""On the GPU: the fast path (Triton attention, Triton fused ops, CUDA graphs) generates the same
greedy tokens as the torch reference path and as transformers, on a tiny random model (fp32)."""

from __future__ import annotations

import pytest
import torch
import transformers

from framework import LLM, SamplingParams
from framework.kernels import get_kernel
from framework.testing import record_step_overlaps, reference_greedy, write_tiny_model

REFERENCE_OPS = ",".join(
    f"{op}=torch"
    for op in (
        "rms_norm",
        "fused_add_rms_norm",
        "silu_and_mul",
        "gelu_tanh_and_mul",
        "rotary_embedding",
        "qk_norm_rotary_embedding",
    )
)


@pytest.mark.gpu
def test_fast_path_greedy_tokens_match_the_reference_path(tmp_path, monkeypatch):
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.1,
    )
    reference = write_tiny_model(tmp_path, config)
    prompts = [
        [int(t) for t in torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(n))] for n in (5, 37, 100)
    ]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    fast = LLM(str(tmp_path), device="cuda", dtype="f32", num_blocks=64)
    assert fast.engine.attention_backend == "triton" and "decode graphs" in fast.engine.summary["cuda_graphs"]
    assert get_kernel("rms_norm").__module__.startswith("fw_triton_ops")
    fast_ids = [r.outputs[0].token_ids for r in fast.generate([{"prompt_token_ids": p} for p in prompts], params)]
    monkeypatch.setenv("FW_KERNELS", REFERENCE_OPS)
    slow = LLM(
        str(tmp_path), device="cuda", dtype="f32", num_blocks=64, attention_backend="torch", enable_cuda_graphs=False
    )
    assert slow.engine.summary["cuda_graphs"] == "off" and get_kernel("rms_norm").__module__.startswith("framework")
    slow_ids = [r.outputs[0].token_ids for r in slow.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert fast_ids == slow_ids
    assert fast_ids == [reference_greedy(reference, p) for p in prompts]


@pytest.mark.gpu
def test_async_decode_steps_never_sync_the_stream_and_match_sync_scheduling(tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.1,
    )
    write_tiny_model(tmp_path, config)
    prompts = [
        [int(t) for t in torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(n))] for n in (5, 37, 100)
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=40, ignore_eos=True, frequency_penalty=0.5),
        SamplingParams(temperature=1.0, top_k=20, seed=4, max_tokens=40, ignore_eos=True),
    ]

    def run(async_scheduling: bool) -> list[tuple]:
        llm = LLM(str(tmp_path), device="cuda", dtype="f32", num_blocks=64, async_scheduling=async_scheduling)
        core = llm.engine.core
        assert core.async_scheduling is async_scheduling
        for index, (prompt, param) in enumerate(zip(prompts, params)):
            core.add_request(str(index), prompt, param)
        outputs = [core.step() for _ in range(4)]  # prefill, then decode steps: warm pinned buffers
        steps = record_step_overlaps(core)
        torch.cuda.set_sync_debug_mode("error")  # any stream synchronisation inside a step raises
        try:
            outputs += [core.step() for _ in range(20)]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert steps.num_overlapped == (20 if async_scheduling else 0)
        outputs.append(core.run_until_done())
        return [
            (out.request_id, out.new_token_ids, out.new_logprobs, out.finish_reason) for step in outputs for out in step
        ]

    assert run(True) == run(False)
