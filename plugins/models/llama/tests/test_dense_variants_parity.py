"""Qwen3, Phi-3, StableLM, GLM and GLM-4 through the whole engine match transformers (fp32, tiny
random models): logits of a batch of mixed-length prompts at every position (prefill chunks of 8,
paged cache) and 32 greedy tokens.

Norm weights and biases, which transformers initialises to the identity (ones, zeros), are
randomised so that every norm (QK norm, GLM-4's branch norms, LayerNorm biases) and every bias
counts.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from framework import LLM
from framework.testing import (
    check_greedy_parity,
    check_kernels_used,
    check_logits_parity,
    count_kernel_calls,
    reference_logits,
    require_triton,
    write_randomised_model,
)

SMALL = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.1,
    pad_token_id=0,
)
# Phi-3 LongRoPE: rotary_dim 8 (partial 0.5 of head 16) -> 4 factors each
SHORT, LONG = [1.0, 1.3, 2.1, 3.7], [1.5, 2.9, 6.0, 11.0]

CONFIGS = {
    # head_dim 32 != hidden / heads = 16, as in the real Qwen3 models
    "qwen3_qk_norm": lambda: transformers.Qwen3Config(**SMALL, head_dim=32),
    "phi3_longrope_partial_sliding": lambda: transformers.Phi3Config(
        **SMALL,
        partial_rotary_factor=0.5,
        sliding_window=12,
        original_max_position_embeddings=64,
        rope_scaling={"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG},
    ),
    "stablelm_parallel_qk_layernorm": lambda: transformers.StableLmConfig(
        **SMALL, partial_rotary_factor=0.25, use_qkv_bias=True, use_parallel_residual=True, qk_layernorm=True
    ),
    "stablelm_sequential": lambda: transformers.StableLmConfig(**SMALL, partial_rotary_factor=0.25),
    "glm_interleaved_partial_rope": lambda: transformers.GlmConfig(**SMALL, head_dim=16, partial_rotary_factor=0.5),
    "glm4_four_norms": lambda: transformers.Glm4Config(**SMALL, head_dim=16, partial_rotary_factor=0.5),
}

PROMPTS = [
    [5, 9, 33, 2, 71],
    list(range(40, 53)),
    [int(x) for x in torch.randint(2, 160, (29,), generator=torch.Generator().manual_seed(1))],
]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(one_thread, request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return path, write_randomised_model(path, CONFIGS[request.param]())


def test_batched_chunked_prefill_logits_match_transformers(tiny):
    check_logits_parity(*tiny, PROMPTS)


def test_greedy_tokens_match_transformers_with_chunked_prefill(tiny):
    check_greedy_parity(*tiny, PROMPTS)


@pytest.fixture(scope="module")
def phi3_long_context(one_thread, tmp_path_factory):
    """A Phi-3 whose prompts pass original_max_position_embeddings (16): the long factors apply."""
    path = tmp_path_factory.mktemp("phi3_long")
    config = transformers.Phi3Config(
        **SMALL,
        partial_rotary_factor=0.5,
        original_max_position_embeddings=16,
        rope_scaling={"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG},
    )
    return path, write_randomised_model(path, config)


def test_phi3_long_factors_past_the_original_context_match_transformers(phi3_long_context):
    """One forward over a 29-token prompt (past the original 16): every position uses the long
    factors in both, and the attention scaling of factor 512 / 16."""
    path, reference = phi3_long_context
    check_logits_parity(path, reference, [PROMPTS[2]], prefill_chunk_size=64, max_num_batched_tokens=64)
    short = transformers.Phi3ForCausalLM(reference.config).eval()
    short.load_state_dict(reference.state_dict())
    short.config.rope_parameters["long_factor"] = SHORT  # the same model with no long factors
    assert (reference_logits(short, PROMPTS[2]) - reference_logits(reference, PROMPTS[2])).abs().max() > 1e-2


def test_phi3_legacy_su_config_with_top_level_original_context(phi3_long_context, tmp_path):
    """Hub Phi-3 configs: ``rope_scaling: {"type": "su"}``, ``original_max_position_embeddings``
    at the top level only; a shorter ``--max-model-len`` keeps the checkpoint's scaling factor."""
    path, reference = phi3_long_context
    config = json.loads((path / "config.json").read_text())
    params = config.pop("rope_parameters")
    config["rope_scaling"] = {
        "type": "su",
        "short_factor": params["short_factor"],
        "long_factor": params["long_factor"],
    }
    config["rope_theta"] = params["rope_theta"]
    config["partial_rotary_factor"] = params["partial_rotary_factor"]
    for name in path.iterdir():
        (tmp_path / name.name).write_bytes(name.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(config))
    check_logits_parity(
        tmp_path, reference, [PROMPTS[2]], prefill_chunk_size=64, max_num_batched_tokens=64, max_model_len=128
    )


def test_qwen3_qk_norm_is_loaded_and_applied(tmp_path):
    """The checkpoint's q_norm / k_norm weights reach the model (a wrong load would pass silently
    if the norms were the identity)."""
    reference = write_randomised_model(tmp_path, CONFIGS["qwen3_qk_norm"]())
    llm = LLM(str(tmp_path), num_blocks=16)
    attention = llm.engine.core.runner.model.model.layers[1].self_attn
    assert torch.equal(attention.q_norm.weight, reference.model.layers[1].self_attn.q_norm.weight)
    assert torch.equal(attention.k_norm.weight, reference.model.layers[1].self_attn.k_norm.weight)
    assert not torch.allclose(attention.q_norm.weight, torch.ones(32))


def test_stablelm_per_head_qk_norms_are_one_stacked_weight_loaded_at_start_up(tmp_path):
    """StableLM's ``q_layernorm.norms.{h}.weight`` fill the rows of one ``[heads, head_size]``
    parameter at load (nothing is stacked per forward); a checkpoint missing a head is refused."""
    from safetensors.torch import load_file, save_file

    from framework.errors import ModelLoadError

    reference = write_randomised_model(tmp_path, CONFIGS["stablelm_parallel_qk_layernorm"]())
    llm = LLM(str(tmp_path), num_blocks=16)
    attention = llm.engine.core.runner.model.model.layers[1].self_attn
    expected = reference.model.layers[1].self_attn
    for ours, theirs in ((attention.q_layernorm, expected.q_layernorm), (attention.k_layernorm, expected.k_layernorm)):
        assert isinstance(ours.weight, torch.nn.Parameter)
        assert torch.equal(ours.weight, torch.stack([norm.weight for norm in theirs.norms]))
    assert not torch.allclose(attention.q_layernorm.weight, torch.ones_like(attention.q_layernorm.weight))
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_layernorm.norms.1.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"layers\.1\.self_attn\.k_layernorm\.norms\.1\.weight"):
        LLM(str(tmp_path), num_blocks=16)


def test_cli_generate_runs_a_glm4_directory(tmp_path):
    """``fw generate --m <dir>`` on a GLM-4 checkpoint: the ids are transformers' greedy ids
    (the word-level tokenizer maps ``t5`` to id 5 and adds no BOS)."""
    from typer.testing import CliRunner

    from cli.main import build_app
    from framework.testing import reference_greedy

    reference = write_randomised_model(tmp_path, CONFIGS["glm4_four_norms"]())
    result = CliRunner().invoke(
        build_app(), ["generate", "t5 t9 t33 t2 t71", "--m", str(tmp_path), "--max-tokens", "8", "--json"]
    )
    assert result.exit_code == 0, result.output
    output = json.loads(result.output)
    assert output["prompt_token_ids"] == [5, 9, 33, 2, 71]
    expected = reference_greedy(reference, [5, 9, 33, 2, 71], steps=8)
    eos = 1  # "</s>" ends the generation when greedy picks it
    assert output["token_ids"] == (expected[: expected.index(eos) + 1] if eos in expected else expected)


@pytest.mark.gpu
def test_gpu_fast_path_greedy_tokens_match_transformers(tiny):
    """Triton attention, Triton rotary (partial, interleaved), SwiGLU and RMS norms, CUDA graphs (fp32):
    every one of them ran (a fallback to the torch reference fails). StableLM's norms are LayerNorms."""
    path, reference = tiny
    with count_kernel_calls() as calls:
        check_greedy_parity(path, reference, PROMPTS, device="cuda", dtype="f32")
    # Qwen3 normalises and rotates query and key in one op; the others rotate alone
    ops = [
        "attention",
        "qk_norm_rotary_embedding" if reference.config.model_type == "qwen3" else "rotary_embedding",
        "silu_and_mul",
    ]
    if reference.config.model_type != "stablelm":
        ops += ["rms_norm", "fused_add_rms_norm"]
    check_kernels_used(calls, dict.fromkeys(ops, "triton"))


def test_qwen3_with_the_triton_qk_norm_rotary_kernel_matches_transformers(one_thread, tmp_path, monkeypatch):
    """The one-launch QK norm + RoPE kernel in the model (interpreted on CPU, forced by name):
    transformers' logits and greedy ids, prompts in chunks and batches."""
    require_triton()
    reference = write_randomised_model(tmp_path, CONFIGS["qwen3_qk_norm"]())
    monkeypatch.setenv("FW_KERNELS", "qk_norm_rotary_embedding=triton")
    with count_kernel_calls() as calls:
        check_logits_parity(tmp_path, reference, PROMPTS[:2])
    check_kernels_used(calls, {"qk_norm_rotary_embedding": "triton"})
