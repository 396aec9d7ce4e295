"""get_rope's frequencies and attention scaling against transformers' ROPE_INIT_FUNCTIONS, and the
full q/k rotation against LlamaRotaryEmbedding + apply_rotary_pos_emb."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from framework.layers.rotary import RotaryEmbedding, get_rope

HEAD_SIZE, NUM_HEADS, NUM_KV_HEADS, MAX_POSITION, BASE = 64, 4, 2, 256, 10000.0

SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn_deepseek": {
        "type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
    "yarn_attention_factor": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "attention_factor": 0.8,
        "beta_fast": 16,
        "truncate": False,
    },
    "longrope": {
        "rope_type": "longrope",
        "original_max_position_embeddings": 64,
        "short_factor": [1.0 + 0.05 * i for i in range(HEAD_SIZE // 2)],
        "long_factor": [1.5 + 0.3 * i for i in range(HEAD_SIZE // 2)],
    },
}


def hf_config(rope_parameters: dict, rotary_dim: int = HEAD_SIZE) -> LlamaConfig:
    params = dict(
        rope_parameters, rope_theta=BASE, rope_type=rope_parameters.get("rope_type", rope_parameters.get("type"))
    )
    if rotary_dim != HEAD_SIZE:
        params["partial_rotary_factor"] = rotary_dim / HEAD_SIZE
    return LlamaConfig(
        hidden_size=HEAD_SIZE * NUM_HEADS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_SIZE,
        max_position_embeddings=MAX_POSITION,
        rope_parameters=params,
    )


def fw_rope(rope_scaling: dict | None, rotary_dim: int = HEAD_SIZE) -> RotaryEmbedding:
    return get_rope(HEAD_SIZE, rotary_dim, MAX_POSITION, BASE, rope_scaling)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("name", ["linear", "llama3", "yarn", "yarn_deepseek", "yarn_attention_factor"])
@pytest.mark.parametrize("rotary_dim", [HEAD_SIZE, HEAD_SIZE // 2])
def test_inv_freq_and_attention_scaling_match_transformers(name, rotary_dim):
    rope = fw_rope(SCALINGS[name], rotary_dim)
    rope_type = SCALINGS[name].get("rope_type", SCALINGS[name].get("type"))
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config(SCALINGS[name], rotary_dim))
    torch.testing.assert_close(rope.compute_inv_freq(), inv_freq, rtol=0, atol=0)
    assert rope.attention_scaling == pytest.approx(attention_factor, rel=1e-12)


def test_yarn_attention_scaling_is_folded_into_cos_sin():
    rope = fw_rope(SCALINGS["yarn"])
    assert rope.attention_scaling > 1.1
    cos, sin = rope.cos_sin_cache.chunk(2, dim=-1)
    torch.testing.assert_close(cos**2 + sin**2, torch.full_like(cos, rope.attention_scaling**2))


def test_longrope_short_and_long_inv_freq_match_transformers():
    rope = fw_rope(SCALINGS["longrope"])
    config = hf_config(SCALINGS["longrope"])
    short, short_scaling = ROPE_INIT_FUNCTIONS["longrope"](config)
    long, long_scaling = ROPE_INIT_FUNCTIONS["longrope"](config, seq_len=65)
    torch.testing.assert_close(rope.compute_inv_freq(), short, rtol=0, atol=0)
    torch.testing.assert_close(rope.compute_inv_freq(long=True), long, rtol=0, atol=0)
    assert rope.attention_scaling == pytest.approx(short_scaling) == pytest.approx(long_scaling)


@pytest.mark.parametrize("rotary_dim", [HEAD_SIZE, 48])
def test_dynamic_ntk_equals_transformers_at_the_full_scaled_length(rotary_dim):
    rope = fw_rope({"type": "dynamic", "factor": 2.0}, rotary_dim)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["dynamic"](
        hf_config({"type": "dynamic", "factor": 2.0}, rotary_dim), seq_len=MAX_POSITION * 2
    )
    torch.testing.assert_close(rope.compute_inv_freq(), inv_freq, rtol=0, atol=0)
    assert rope.attention_scaling == attention_factor == 1.0
    assert rope.cos_sin_cache.shape == (MAX_POSITION * 2, rotary_dim)


def hf_rotate(config: LlamaConfig, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    q_rot, k_rot = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    return q_rot[0].transpose(0, 1), k_rot[0].transpose(0, 1)


@pytest.mark.parametrize("name", [None, "llama3", "linear", "yarn", "yarn_deepseek", "dynamic"])
def test_rotation_matches_llama_rotary_embedding(name):
    scaling = SCALINGS.get(name) or ({"rope_type": "dynamic", "factor": 2.0} if name == "dynamic" else None)
    num_positions = MAX_POSITION * 2 if name == "dynamic" else MAX_POSITION
    # transformers' dynamic NTK equals the static table only for a sequence of the full scaled length
    positions = torch.cat([torch.randint(0, num_positions, (15,)), torch.tensor([num_positions - 1])])
    q, k = torch.randn(16, NUM_HEADS, HEAD_SIZE), torch.randn(16, NUM_KV_HEADS, HEAD_SIZE)
    out_q, out_k = fw_rope(scaling)(positions, q.flatten(1), k.flatten(1))
    ref_q, ref_k = hf_rotate(hf_config(scaling or {"rope_type": "default"}), positions, q, k)
    torch.testing.assert_close(out_q.view_as(q), ref_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_k.view_as(k), ref_k, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("max_seen", [40, 200])
def test_longrope_switches_to_long_factors_once_a_position_passes_the_original_context(max_seen):
    positions = torch.cat([torch.randint(0, max_seen, (7,)), torch.tensor([max_seen])])
    q, k = torch.randn(8, NUM_HEADS, HEAD_SIZE), torch.randn(8, NUM_KV_HEADS, HEAD_SIZE)
    out_q, out_k = fw_rope(SCALINGS["longrope"])(positions, q.flatten(1), k.flatten(1))
    ref_q, ref_k = hf_rotate(hf_config(SCALINGS["longrope"]), positions, q, k)
    torch.testing.assert_close(out_q.view_as(q), ref_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_k.view_as(k), ref_k, rtol=1e-5, atol=1e-5)


def test_rotation_in_bf16_stays_close_to_transformers():
    positions = torch.randint(0, MAX_POSITION, (16,))
    q, k = torch.randn(16, NUM_HEADS, HEAD_SIZE).bfloat16(), torch.randn(16, NUM_KV_HEADS, HEAD_SIZE).bfloat16()
    out_q, out_k = fw_rope(SCALINGS["llama3"])(positions, q.flatten(1), k.flatten(1))
    ref_q, ref_k = hf_rotate(hf_config(SCALINGS["llama3"]), positions, q, k)
    assert out_q.dtype == torch.bfloat16
    torch.testing.assert_close(out_q.view_as(q), ref_q, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out_k.view_as(k), ref_k, rtol=2e-2, atol=2e-2)


def test_meta_construction_then_to_empty_gives_the_real_table():
    expected = RotaryEmbedding(HEAD_SIZE, 32, MAX_POSITION, BASE, is_neox_style=False).cos_sin_cache
    with torch.device("meta"):
        rope = RotaryEmbedding(HEAD_SIZE, 32, MAX_POSITION, BASE, is_neox_style=False)
    assert rope.cos_sin_cache.device.type == "meta"
    assert "cos_sin_cache" not in rope.state_dict()
    rope.to_empty(device="cpu")
    torch.testing.assert_close(rope.cos_sin_cache, expected, rtol=0, atol=0)
    rope.cos_sin_cache.fill_(7.0)
    rope.init_buffers("cpu")
    torch.testing.assert_close(rope.cos_sin_cache, expected, rtol=0, atol=0)


def test_casting_the_model_keeps_the_table_in_float32():
    rope = RotaryEmbedding(HEAD_SIZE, HEAD_SIZE, MAX_POSITION, BASE)
    expected = rope.cos_sin_cache.clone()
    rope.to(torch.bfloat16)
    assert rope.cos_sin_cache.dtype == torch.float32
    torch.testing.assert_close(rope.cos_sin_cache, expected, rtol=0, atol=0)


def test_get_rope_shares_one_module_per_configuration():
    assert fw_rope(SCALINGS["llama3"]) is fw_rope(dict(SCALINGS["llama3"]))
    assert fw_rope(None) is fw_rope({"rope_type": "default", "rope_theta": BASE})
    assert fw_rope(None) is not fw_rope(SCALINGS["linear"])


def test_get_rope_names_valid_types_and_missing_keys():
    with pytest.raises(ValueError, match="unknown rope type 'su'.*llama3.*yarn"):
        fw_rope({"rope_type": "su"})
    with pytest.raises(ValueError, match="needs 'low_freq_factor'"):
        fw_rope({"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match="32 short and long factors, got 3"):
        fw_rope(dict(SCALINGS["longrope"], short_factor=[1.0, 1.0, 1.0]))


@pytest.mark.parametrize("name", ["default", "longrope"])
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["qwen3", "gemma3"])
def test_rotation_with_qk_norm_equals_norm_per_head_then_rotation(name, offset):
    """``forward_with_qk_norm`` (here, without a fused kernel: the registry's norm and rotary) gives exactly the per-head RMS norms followed by
    ``forward``, past LongRoPE's original context too (its long rows)."""
    from framework.layers import RMSNorm, norm_per_head

    rope = get_rope(HEAD_SIZE, HEAD_SIZE, MAX_POSITION, BASE, SCALINGS.get(name))
    q_norm, k_norm = RMSNorm(HEAD_SIZE, 1e-6, offset=offset), RMSNorm(HEAD_SIZE, 1e-6, offset=offset)
    with torch.no_grad():
        q_norm.weight.copy_(torch.randn(HEAD_SIZE))
        k_norm.weight.copy_(torch.randn(HEAD_SIZE))
    positions = torch.tensor([0, 5, 63, 64, 200])
    q, k = torch.randn(5, NUM_HEADS * HEAD_SIZE), torch.randn(5, NUM_KV_HEADS * HEAD_SIZE)
    expected = rope(positions, norm_per_head(q_norm, q, HEAD_SIZE), norm_per_head(k_norm, k, HEAD_SIZE))
    for got, want in zip(rope.forward_with_qk_norm(positions, q, k, q_norm, k_norm), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="differ in eps or offset"):
        rope.forward_with_qk_norm(positions, q, k, q_norm, RMSNorm(HEAD_SIZE, 1e-5, offset=offset))


def test_get_rope_builds_a_new_module_when_fw_kernels_forces_another_kernel(monkeypatch):
    """A shared module holds the kernels chosen when it was built, so forcing one with FW_KERNELS
    afterwards must not hand out the module built before."""
    monkeypatch.delenv("FW_KERNELS", raising=False)
    before = get_rope(HEAD_SIZE, HEAD_SIZE, MAX_POSITION, BASE)
    monkeypatch.setenv("FW_KERNELS", "rotary_embedding=torch")
    forced = get_rope(HEAD_SIZE, HEAD_SIZE, MAX_POSITION, BASE)
    assert forced is not before and forced is get_rope(HEAD_SIZE, HEAD_SIZE, MAX_POSITION, BASE)


@pytest.mark.parametrize("partial, factor", [(0.25, 1.0), (0.5, 2.0)])
def test_proportional_rope_matches_transformers_and_leaves_the_rest_unrotated(partial, factor):
    """Gemma 4's global layers: the frequencies of a full-width rotation for the first
    ``partial * head_size`` features' pairs, zeros for the others (those pass through)."""
    config = hf_config({"rope_type": "proportional", "partial_rotary_factor": partial, "factor": factor})
    expected, _ = ROPE_INIT_FUNCTIONS["proportional"](config)
    rotated = 2 * int(partial * HEAD_SIZE // 2)
    rope = get_rope(HEAD_SIZE, rotated, MAX_POSITION, BASE, {"rope_type": "proportional", "factor": factor})
    assert rope.cos_sin_cache.shape[-1] == HEAD_SIZE
    torch.testing.assert_close(rope.compute_inv_freq(), expected, rtol=0, atol=0)
    positions = torch.tensor([0, 5, 200])
    query, key = torch.randn(3, NUM_HEADS * HEAD_SIZE), torch.randn(3, NUM_KV_HEADS * HEAD_SIZE)
    q, k = rope(positions, query, key)
    heads = lambda x: x.view(3, -1, HEAD_SIZE)  # noqa: E731
    half = HEAD_SIZE // 2
    for idle in (slice(rotated // 2, half), slice(half + rotated // 2, HEAD_SIZE)):  # zero frequency: unchanged
        torch.testing.assert_close(heads(q)[..., idle], heads(query)[..., idle])
    assert not torch.allclose(heads(k)[1:, :, : rotated // 2], heads(key)[1:, :, : rotated // 2])
