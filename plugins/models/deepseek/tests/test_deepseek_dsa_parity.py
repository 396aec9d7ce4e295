"""DeepSeek-V3.2 and GLM-5 (DeepSeek Sparse Attention) match transformers (fp32, tiny random models).

End to end with ``index_topk`` above every sequence length (the indexer chooses every earlier
token, so greedy ids and logits are exact however random weights tie): mixed-length prompts with
chunked prefill, 32 greedy tokens, a prefix-cache hit and preemption. The sparse choice itself
(``index_topk`` below the context) is checked on its own against transformers' indexer, comparing
chosen sets robustly where ReLU'd scores tie, and end to end on a model whose scores do not tie.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import transformers
from fw_torch_attention.backend import TorchAttentionBackend

from framework import LLM, hookimpl
from framework.errors import ConfigError
from framework.specs import AttentionBackendSpec
from framework.testing import ModelParityTests, tiny_model_fixture, write_grouped_moe_model

SMALL = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=24,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    mlp_layer_types=["dense", "sparse"],
    max_position_embeddings=512,
    initializer_range=0.1,
    index_n_heads=4,
    index_head_dim=16,
    index_topk=128,  # > every test sequence: dense attention through the sparse path
)
LATENT = SMALL["kv_lora_rank"] + SMALL["qk_rope_head_dim"]

CONFIGS = {
    "deepseek_v32_yarn": lambda: transformers.DeepseekV32Config(  # as released: YaRN with DeepSeek's mscale
        **SMALL,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    ),
    "glm_moe_dsa_shared_layer": lambda: transformers.GlmMoeDsaConfig(**SMALL, indexer_types=["full", "shared"]),
}

pytestmark = pytest.mark.usefixtures("one_thread")

tiny = tiny_model_fixture(CONFIGS, write=write_grouped_moe_model)


class TestParity(ModelParityTests):
    """Logits and greedy ids against transformers: batched chunked prefill, a prefix-cache hit, preemption."""


def test_cache_rows_hold_the_latent_then_the_indexer_key(tiny):
    """A layer with an indexer caches kv_lora_rank + qk_rope_head_dim + index_head_dim numbers per
    token; GLM-5's shared layer (no indexer) only the latent."""
    path, reference = tiny
    llm = LLM(str(path), num_blocks=8)
    widths = [c.data.shape[-1] for c in llm.engine.core.runner.kv_caches]
    shared = getattr(reference.config, "indexer_types", ["full", "full"])
    assert widths == [LATENT + (SMALL["index_head_dim"] if t == "full" else 0) for t in shared]
    assert llm.engine.attention_backend == "torch"


def _indexer_pair(hf_config):
    """transformers' layer-0 indexer (random weights) and fw's with the same weights (and the
    rotary style fw's model class gives it)."""
    from fw_deepseek import dsa
    from fw_deepseek.indexer import LightningIndexer

    from framework.config import ModelConfig

    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(hf_config).float().eval()
    architecture = type(reference).__name__
    config = ModelConfig.from_hf_config({**hf_config.to_dict(), "architectures": [architecture]}, dtype=torch.float32)
    is_neox_style = getattr(dsa, architecture).indexer_rope_is_neox
    ours = LightningIndexer(config, 0, None, "indexer", is_neox_style=is_neox_style)
    hf_indexer = reference.model.layers[0].self_attn.indexer
    missing, unexpected = ours.load_state_dict(hf_indexer.state_dict(), strict=False)
    assert not unexpected and all("rotary" in name for name in missing)
    return reference, hf_indexer, ours


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_sparse_selection_matches_transformers_indexer(name):
    """``index_topk`` 5 of 40 tokens: fw's chosen set is transformers' wherever the 5th and 6th
    scores differ; where they tie (ReLU zeros), the chosen scores are the same multiset."""
    from fw_deepseek.indexer import select_topk

    topk, length = 5, 40
    reference, hf_indexer, ours = _indexer_pair(CONFIGS[name]().__class__(**{**SMALL, "index_topk": topk}))
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, length, SMALL["hidden_size"], generator=generator)
    q_resid = torch.randn(1, length, SMALL["q_lora_rank"], generator=generator)
    positions = torch.arange(length)[None]
    causal = torch.full((length, length), torch.finfo(torch.float32).min).triu(1)[None]
    with torch.no_grad():
        expected = hf_indexer(hidden, q_resid, reference.model.rotary_emb(hidden, positions), causal, positions)[0]
        query, key, weights = ours.project(positions[0], hidden[0], q_resid[0])
        chosen = select_topk(query, weights, key, 0, topk)
        # the scores by fw's own definition, to tell ties from disagreements
        scores = torch.einsum("qh,qhk->qk", weights, torch.relu(query @ key.T * SMALL["index_head_dim"] ** -0.5))
    assert chosen.shape == (length, topk)
    assert (chosen[: topk - 1] == -1).any(dim=1).all()  # early queries have fewer causal tokens than topk
    num_strict = 0
    for row in range(topk, length):
        causal_scores = scores[row, : row + 1].sort(descending=True).values
        if causal_scores[topk - 1] - causal_scores[topk] > 1e-4:
            assert set(chosen[row].tolist()) == set(expected[row].tolist()), row
            num_strict += 1
        else:
            torch.testing.assert_close(scores[row, chosen[row]].sort().values, scores[row, expected[row]].sort().values)
    assert num_strict >= (length - topk) // 2  # most rows had a unique answer
    for row in range(topk - 1):  # fewer causal tokens than topk: all of them
        assert set(chosen[row].tolist()) - {-1} == set(range(row + 1))


@contextlib.contextmanager
def cut_gaps(monkeypatch, topk: int):
    """Collect, for every query fw's indexer scores with more causal tokens than ``topk``, the gap
    between its ``topk``-th and next score (a parity test of the sparse choice needs no ties)."""
    from fw_deepseek import indexer

    gaps: list[float] = []

    def spy(*args):
        scores = original(*args)
        ranked = scores.sort(dim=-1, descending=True).values
        if ranked.shape[1] > topk:
            cut = ranked[:, topk - 1] - ranked[:, topk]
            gaps.extend(cut[torch.isfinite(ranked[:, topk])].tolist())
        return scores

    original = indexer.index_scores
    monkeypatch.setattr(indexer, "index_scores", spy)
    yield gaps
    monkeypatch.setattr(indexer, "index_scores", original)
    assert gaps, "the indexer never had more tokens than topk to choose from"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_sparse_attention_end_to_end_matches_transformers(tmp_path, monkeypatch, name):
    """``index_topk`` 6 below the prompts' lengths, 16 indexer heads (so the ReLU'd scores do not tie
    at the cut): logits of every position with chunked prefill and greedy ids match transformers
    (GLM-5's second layer attends to the first layer's choice)."""
    from framework.testing import PARITY_PROMPTS, check_greedy_parity, check_logits_parity

    written = CONFIGS[name]()
    config = type(written)(**{**written.to_dict(), "index_topk": 6, "index_n_heads": 16})
    reference = write_grouped_moe_model(tmp_path, config)
    with cut_gaps(monkeypatch, config.index_topk) as gaps:
        try:
            check_logits_parity(tmp_path, reference, PARITY_PROMPTS)
        finally:  # a tie at the cut makes any choice right: say so rather than blame the logits
            assert min(gaps) > 1e-4, f"scores tie at the cut (gap {min(gaps):.2g}): pick weights without ties"
    check_greedy_parity(tmp_path, reference, PARITY_PROMPTS[1:2], steps=12)


class DenseMLABackend(TorchAttentionBackend):
    """Reads the MLA layout but not sparse MLA (as a fast MLA backend without DSA would)."""

    name = "dense_mla_only"
    supports_sparse_mla = False


class DenseMLAOnlyPlugin:
    @hookimpl
    def register_attention_backends(self):
        return [
            AttentionBackendSpec(
                name="dense_mla_only", impl=f"{__name__}:DenseMLABackend", priority=100, kv_cache_layouts=("mla",)
            )
        ]


def test_backend_without_sparse_mla_is_refused_with_the_reason(tiny, register_fw_plugin, caplog):
    path, _ = tiny
    register_fw_plugin(DenseMLAOnlyPlugin(), "dense_mla_only")
    with caplog.at_level("INFO", logger="fw.engine"):
        llm = LLM(str(path), num_blocks=8)
    assert llm.engine.attention_backend == "torch"
    assert "dense_mla_only not used: DeepSeek sparse attention" in caplog.text
    with pytest.raises(ConfigError, match="'dense_mla_only' cannot run: DeepSeek sparse attention"):
        LLM(str(path), num_blocks=8, attention_backend="dense_mla_only")


def test_shared_first_layer_is_refused():
    from fw_deepseek.dsa import indexer_types

    from framework.config import ModelConfig

    hf = transformers.GlmMoeDsaConfig(**SMALL, indexer_types=["shared", "full"]).to_dict()
    config = ModelConfig.from_hf_config({**hf, "architectures": ["GlmMoeDsaForCausalLM"]}, dtype=torch.float32)
    with pytest.raises(ConfigError, match="first layer must be 'full'"):
        indexer_types(config)
    derived = {**hf, "indexer_types": None, "index_topk_freq": 2, "index_skip_topk_offset": 1}
    config = ModelConfig.from_hf_config({**derived, "architectures": ["GlmMoeDsaForCausalLM"]}, dtype=torch.float32)
    assert indexer_types(config) == ["full", "shared"]  # transformers' schedule


def test_tensor_parallel_2_sparse_greedy_ids_match_transformers(tmp_path):
    """TP=2 on CPU (gloo), ``index_topk`` 6: each rank runs half the MLA heads and the whole
    (replicated) indexer, so both ranks attend to the same tokens; GLM-5's shared layer included."""
    from framework import SamplingParams
    from framework.testing import PARITY_PROMPTS, reference_greedy

    written = CONFIGS["glm_moe_dsa_shared_layer"]()
    reference = write_grouped_moe_model(
        tmp_path, type(written)(**{**written.to_dict(), "index_topk": 6, "index_n_heads": 16})
    )
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = PARITY_PROMPTS[1:]
    with LLM(str(tmp_path), num_blocks=16, prefill_chunk_size=8, tensor_parallel_size=2) as llm:
        ids = [r.outputs[0].token_ids for r in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)]
    assert ids == [reference_greedy(reference, prompt, greedy.max_tokens) for prompt in prompts]


@pytest.mark.gpu
def test_sparse_greedy_tokens_match_transformers_on_cuda(tmp_path):
    """On the GPU: the torch backend (the only one with sparse MLA) and the indexer over the
    widened cache rows, the registry's Triton fused_moe, fp32, against transformers on the CPU."""
    from framework import SamplingParams
    from framework.testing import PARITY_PROMPTS, check_kernels_used, count_kernel_calls, reference_greedy

    for name, written in sorted(CONFIGS.items()):
        path = tmp_path / name
        config = written()
        reference = write_grouped_moe_model(
            path, type(config)(**{**config.to_dict(), "index_topk": 6, "index_n_heads": 16})
        )
        greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        with count_kernel_calls() as calls:
            llm = LLM(str(path), device="cuda", dtype="float32", num_blocks=64, prefill_chunk_size=8)
            assert llm.engine.attention_backend == "torch"
            results = llm.generate([{"prompt_token_ids": p} for p in PARITY_PROMPTS], greedy)
        for prompt, result in zip(PARITY_PROMPTS, results, strict=True):
            assert result.outputs[0].token_ids == reference_greedy(reference, prompt, greedy.max_tokens), name
        check_kernels_used(calls, {"fused_moe": "triton", "attention": "torch"})
