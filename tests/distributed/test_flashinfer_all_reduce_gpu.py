"""``--all-reduce flashinfer`` on two GPUs: FlashInfer's fused all-reduce + residual add + RMS norm
against the unfused path (NCCL's sum, then ``framework.ops.fused_add_rms_norm``), eagerly and
replayed from a CUDA graph; and a TP=2 engine that uses it.

Skipped unless two CUDA devices and FlashInfer are present. FlashInfer compiles its kernel on first
use (minutes without its JIT cache).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.multiprocessing as mp
import transformers

from framework import SamplingParams, ops
from framework.distributed.config import free_port
from framework.testing import generate_in_new_process, reference_greedy, write_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer"),
]

HIDDEN, MAX_TOKENS = 4096, 64
#: the fused kernel sums in fp32 and rounds the residual and the norm once each, as the reference
#: does up to the order of the sum: a unit or two of bf16
TOLERANCE = {torch.bfloat16: dict(rtol=2e-2, atol=2e-2), torch.float32: dict(rtol=1e-5, atol=1e-5)}


def _inputs(rank: int, tokens: int, dtype: torch.dtype, round_: int):
    generator = torch.Generator().manual_seed(1000 * rank + 17 * round_ + tokens)
    x = torch.randn(tokens, HIDDEN, generator=generator).to(dtype).cuda()
    shared = torch.Generator().manual_seed(5 + round_ + tokens)  # the residual and weight are the same on every rank
    residual = torch.randn(tokens, HIDDEN, generator=shared).to(dtype).cuda()
    weight = (torch.randn(HIDDEN, generator=shared) * 0.1 + 1).to(dtype).cuda()
    return x, residual, weight


def _unfused(x, residual, weight, offset):
    import torch.distributed as dist

    total = x.clone()
    dist.all_reduce(total)
    return ops.fused_add_rms_norm(total, residual, weight, 1e-6, offset)


def _worker(rank: int, port: int) -> None:
    from framework import distributed
    from framework.distributed.state import _state

    device = torch.device("cuda", rank)
    distributed.init_tensor_parallel(rank, 2, device, master_port=port, rendezvous_timeout_s=600, timeout_s=600)
    try:
        for dtype in (torch.bfloat16, torch.float32):
            distributed.enable_flashinfer_all_reduce_norm(device, MAX_TOKENS, HIDDEN, dtype)
            fused = _state.fused_all_reduce_norm
            for tokens, offset in [(1, 0.0), (7, 1.0), (64, 0.0)]:
                x, residual, weight = _inputs(rank, tokens, dtype, 0)
                assert fused.fits(x)
                got = distributed.all_reduce_add_rms_norm(x, residual, weight, 1e-6, offset, ops.fused_add_rms_norm)
                for g, want in zip(got, _unfused(x, residual, weight, offset), strict=True):  # normed, new residual
                    torch.testing.assert_close(g, want, **TOLERANCE[dtype])
            assert not fused.fits(torch.empty(MAX_TOKENS + 1, HIDDEN, dtype=dtype, device=device))
            # captured in a graph (as the decode graphs hold it), replayed with new inputs
            static = _inputs(rank, 3, dtype, 0)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream):
                distributed.all_reduce_add_rms_norm(*static, 1e-6, 0.0, ops.fused_add_rms_norm)  # warm-up
                torch.cuda.synchronize()
                with torch.cuda.graph(graph, stream=stream):
                    outputs = distributed.all_reduce_add_rms_norm(*static, 1e-6, 0.0, ops.fused_add_rms_norm)
            torch.cuda.synchronize()
            for round_ in range(1, 4):
                fresh = _inputs(rank, 3, dtype, round_)
                for tensor, new in zip(static, fresh, strict=True):
                    tensor.copy_(new)
                graph.replay()
                torch.cuda.synchronize()
                for g, want in zip(outputs, _unfused(*fresh, 0.0), strict=True):
                    torch.testing.assert_close(g, want, **TOLERANCE[dtype])
            del graph
            fused.close()
            _state.fused_all_reduce_norm = None
        torch.cuda.synchronize()
    finally:
        distributed.destroy_tensor_parallel()


def test_fused_all_reduce_norm_equals_the_unfused_path_eagerly_and_in_a_cuda_graph():
    mp.spawn(_worker, args=(free_port(),), nprocs=2, join=True)


def test_tp2_fp32_with_the_flashinfer_all_reduce_gives_the_greedy_ids_of_transformers(tmp_path):
    """Every layer's norms take the all-reduce (Llama's decoder defers it under TP) and decode
    steps run FlashInfer's fused kernel inside the CUDA graphs."""
    reference = write_tiny_model(
        tmp_path,
        transformers.LlamaConfig(
            vocab_size=250,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            initializer_range=0.1,
        ),
    )
    prompts = [[5, 9, 33, 2, 71], list(range(40, 77)), [3, 150, 77]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ids, _, summary = generate_in_new_process(
        tmp_path,
        prompts,
        params,
        num_blocks=64,
        max_num_seqs=8,
        device_ids=[0, 1],
        dtype="f32",
        all_reduce="flashinfer",
    )
    assert summary["all_reduce"] == "flashinfer" and "decode graphs" in summary["cuda_graphs"]
    assert ids == [reference_greedy(reference, p, params.max_tokens) for p in prompts]


def test_auto_takes_the_fused_all_reduce_for_bf16_where_its_module_is_built(tmp_path):
    """``--all-reduce auto`` (the default) on two GPUs of one host with FlashInfer's module built:
    the summary names ``flashinfer``, and the greedy ids are those of asking for it by name."""
    from framework.distributed.flashinfer_all_reduce import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"auto would not take it here: {reason}")
    write_tiny_model(
        tmp_path,
        transformers.LlamaConfig(
            vocab_size=250,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            initializer_range=0.1,
        ),
    )
    prompts = [[5, 9, 33, 2, 71], [3, 150, 77]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    runs = {
        name: generate_in_new_process(
            tmp_path, prompts, params, num_blocks=64, max_num_seqs=8, device_ids=[0, 1], dtype="bf16", all_reduce=name
        )
        for name in ("auto", "flashinfer")
    }
    assert runs["auto"][2]["all_reduce"] == "flashinfer"
    assert runs["auto"][0] == runs["flashinfer"][0]
