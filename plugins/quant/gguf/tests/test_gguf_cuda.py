"""On the GPU: a K-quant GGUF (Q4_K with Q6_K v/down/head, as Q4_K_M files are, and one F16 matrix) runs through the
engine with CUDA graphs on the packed Triton kernels and gives the greedy tokens of the torch
dequantize-then-matmul path (itself captured in graphs: the capture that used to crash); and
the kernels against the torch reference on CUDA in bf16."""

from __future__ import annotations

import gc

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from framework import LLM, SamplingParams

pytestmark = pytest.mark.gpu

HIDDEN, FFN, HEADS, KV_HEADS, VOCAB, LAYERS = 256, 512, 4, 2, 512, 2
# fp16 fields (byte offsets) and their magnitude: values stay O(1), so activations stay finite
_SCALES = {Q.Q4_K: ((0, 2e-3), (2, 2e-3)), Q.Q6_K: ((208, 1e-4),)}


def _blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks: random quant bytes, fp16 scales of a sane size and random sign (so that
    Q4_K's offsets do not give every row the same positive mean and every token the same logits)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    for offset, size in _SCALES[qtype]:
        scale = rng.standard_normal((blocks.shape[0], 1)) * size
        blocks[:, offset : offset + 2] = scale.astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def write_kquant_llama(path) -> None:
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in {
        "context_length": 1024,
        "embedding_length": HIDDEN,
        "feed_forward_length": FFN,
        "block_count": LAYERS,
        "attention.head_count": HEADS,
        "attention.head_count_kv": KV_HEADS,
        "rope.dimension_count": HIDDEN // HEADS,
    }.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"t{i}" for i in range(VOCAB)])
    writer.add_token_scores([0.0] * VOCAB)
    writer.add_token_types([1] * VOCAB)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)

    def matrix(name, qtype, rows, cols):
        writer.add_tensor(name, _blocks(qtype, rows, cols, rng), raw_dtype=qtype)

    matrix("token_embd.weight", Q.Q4_K, VOCAB, HIDDEN)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    matrix("output.weight", Q.Q6_K, VOCAB, HIDDEN)
    head_dim = HIDDEN // HEADS
    for i in range(LAYERS):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        matrix(f"blk.{i}.attn_q.weight", Q.Q4_K, HIDDEN, HIDDEN)
        matrix(f"blk.{i}.attn_k.weight", Q.Q4_K, KV_HEADS * head_dim, HIDDEN)
        matrix(f"blk.{i}.attn_v.weight", Q.Q6_K, KV_HEADS * head_dim, HIDDEN)
        if i == 1:  # a float tensor among the blocks: a dense bf16 matrix on the GPU
            writer.add_tensor(
                f"blk.{i}.attn_output.weight", (rng.standard_normal((HIDDEN, HIDDEN)) * 0.05).astype(np.float16)
            )
        else:
            matrix(f"blk.{i}.attn_output.weight", Q.Q4_K, HIDDEN, HIDDEN)
        matrix(f"blk.{i}.ffn_gate.weight", Q.Q4_K, FFN, HIDDEN)
        matrix(f"blk.{i}.ffn_up.weight", Q.Q4_K, FFN, HIDDEN)
        matrix(f"blk.{i}.ffn_down.weight", Q.Q6_K, HIDDEN, FFN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _generate(path, prompts, steps):
    llm = LLM(str(path), device="cuda", dtype="bf16", num_blocks=64)
    assert "decode graphs" in llm.engine.summary["cuda_graphs"]
    model = llm.engine.core.runner.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    o_proj = model.model.layers[1].self_attn.o_proj
    assert o_proj.gguf_dense is not None and o_proj.gguf_dense.dtype == torch.bfloat16
    layout = (list(qkv.gguf_planar), list(qkv.gguf_groups), [t.name for t in qkv.gguf_types])
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    tokens = [r.outputs[0].token_ids for r in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    del llm, model, qkv, o_proj
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, layout


def test_kquant_engine_with_cuda_graphs_matches_the_dequantized_path(tmp_path, monkeypatch):
    import fw_gguf.kernels.matmul as matmul
    import fw_gguf.kernels.mmq as mmq
    import fw_gguf.method as method

    # the tile kernels are exact in x; the MMQ that 2..16 rows take by default rounds x to int8 (its own
    # tests compare it against that rounding), so it would part from the dequantized path at near-ties
    monkeypatch.setattr(mmq, "MMQ_ENABLED", False)
    path = tmp_path / "tiny-llama-q4_k_m.gguf"
    write_kquant_llama(path)
    gen = torch.Generator().manual_seed(1)
    # a batch of 3 decodes (the tensor-core GEMV form), one prompt past DEQUANTIZE_MIN_ROWS (cuBLAS)
    prompts = [[5, 9, 33, 2, 71], [int(t) for t in torch.randint(2, VOCAB, (300,), generator=gen)], [7, 8]]
    calls = {"matmul": 0}
    real = matmul.gguf_matmul

    def counted(*args, **kwargs):
        calls["matmul"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(matmul, "gguf_matmul", counted)
    kernels, layout = _generate(path, prompts, 16)
    assert calls["matmul"] > 0 and layout == ([True] * 3, [(0, 2), (2, 3)], ["Q4_K", "Q4_K", "Q6_K"])
    monkeypatch.setattr(method, "uses_kernels", lambda layer, x: False)  # torch dequantization in every apply
    reference, layout = _generate(path, prompts, 16)
    assert kernels == reference and all(len(t) == 16 for t in kernels)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q5_K, Q.Q4_0, Q.IQ4_XS], ids=lambda q: q.name)
def test_cuda_kernels_match_the_torch_reference_in_bf16(qtype, random_packed):
    from fw_gguf.dequant import dequantize
    from fw_gguf.kernels.layout import to_planar
    from fw_gguf.kernels.matmul import gguf_dequantize, gguf_matmul

    n, k = 301, 1024
    packed = torch.from_numpy(random_packed(qtype, n, k, seed=int(qtype))).cuda()
    reference = dequantize(packed, qtype, (n, k))
    planar = to_planar(packed, qtype)
    exact = gguf_dequantize(planar, qtype, n, k, torch.float32, planar=True)
    assert torch.equal(exact.view(torch.int32), reference.view(torch.int32))
    assert torch.equal(gguf_dequantize(packed.reshape(-1), qtype, n, k, torch.bfloat16), reference.bfloat16())
    for rows in (1, 3, 8, 16, 64, 300):
        x = torch.randn(rows, k, device="cuda").bfloat16()
        expected = x.double() @ reference.double().T
        got = gguf_matmul(x, planar, qtype, n, k, planar=True)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
