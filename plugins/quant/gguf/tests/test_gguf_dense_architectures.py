"""qwen3, phi3, stablelm and glm4 GGUF files through the whole engine give the same greedy ids as the
same model's safetensors checkpoint.

Each test writes a tiny random transformers model, converts it to a float32 GGUF the way
llama.cpp's converter does (tensor names from gguf-py's own HF -> GGUF table, llama.cpp's
metadata keys, Phi-3's LongRoPE factors as tensors, StableLM's per-head QK norms stacked), and
compares fw on the two files.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file

from framework import LLM, SamplingParams
from framework.testing import randomise_identity_params, reference_greedy, write_tiny_model

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
SHORT, LONG = [1.0, 1.3, 2.1, 3.7], [1.5, 2.9, 6.0, 11.0]
PROMPTS = [
    [5, 9, 33, 2, 71],
    [int(x) for x in torch.randint(2, 160, (29,), generator=torch.Generator().manual_seed(1))],
]
STEPS = 32


pytestmark = pytest.mark.usefixtures("one_thread")


def gguf_metadata(arch: str, config) -> dict:
    """The `{arch}.*` keys llama.cpp's converter writes for this config."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = config.rope_parameters
    md = {
        "context_length": config.max_position_embeddings,
        "embedding_length": config.hidden_size,
        "feed_forward_length": config.intermediate_size,
        "block_count": config.num_hidden_layers,
        "attention.head_count": config.num_attention_heads,
        "attention.head_count_kv": config.num_key_value_heads,
        "rope.freq_base": float(rope["rope_theta"]),
        "rope.dimension_count": int(head_dim * rope.get("partial_rotary_factor", 1.0)),
    }
    if arch == "stablelm":
        md["attention.layer_norm_epsilon"] = config.layer_norm_eps
    else:
        md["attention.layer_norm_rms_epsilon"] = config.rms_norm_eps
    if arch in ("qwen3", "glm4"):  # configs with head_dim
        md["attention.key_length"] = md["attention.value_length"] = head_dim
    if arch == "phi3":
        md["rope.scaling.original_context_length"] = config.original_max_position_embeddings
    return md


def write_gguf(
    hf_dir, path, arch: str, config, matrix_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32
) -> None:
    """Convert the safetensors checkpoint in ``hf_dir`` to a GGUF at ``path``: weight matrices
    as ``matrix_type``, everything else float32."""
    writer = gguf.GGUFWriter(path, arch)
    for key, value in gguf_metadata(arch, config).items():
        if isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", value)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    writer.add_token_scores([0.0] * config.vocab_size)
    writer.add_token_types([1] * config.vocab_size)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    name_map = gguf.get_tensor_name_map(
        next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), config.num_hidden_layers
    )
    tensors = load_file(hf_dir / "model.safetensors")
    stacked: dict[str, list[torch.Tensor]] = {}
    for hf_name, tensor in sorted(tensors.items()):
        if ".norms." in hf_name:  # StableLM per-head QK norm: llama.cpp stacks the heads
            stacked.setdefault(hf_name.split(".norms.")[0], []).append(tensor)
            continue
        base, suffix = hf_name.rsplit(".", 1)
        gguf_name, values = f"{name_map.get_name(base)}.{suffix}", tensor.float().numpy()
        if tensor.dim() == 2 and "norm" not in hf_name and matrix_type != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, gguf.quants.quantize(values, matrix_type), raw_dtype=matrix_type)
        else:
            writer.add_tensor(gguf_name, values)
    for base, heads in stacked.items():
        writer.add_tensor(f"{name_map.get_name(base)}.weight", torch.stack(heads).float().numpy())
    if arch == "phi3":
        writer.add_tensor("rope_factors_long.weight", np.array(config.rope_parameters["long_factor"], dtype=np.float32))
        writer.add_tensor(
            "rope_factors_short.weight", np.array(config.rope_parameters["short_factor"], dtype=np.float32)
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


CONFIGS = {
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=32),
    "phi3": lambda: transformers.Phi3Config(
        **SMALL,
        partial_rotary_factor=0.5,
        original_max_position_embeddings=64,
        rope_scaling={"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG},
    ),
    "glm4": lambda: transformers.Glm4Config(**SMALL, head_dim=16, partial_rotary_factor=0.5),
    "stablelm": lambda: transformers.StableLmConfig(
        **SMALL, partial_rotary_factor=0.25, use_qkv_bias=True, use_parallel_residual=True, qk_layernorm=True
    ),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def converted(one_thread, request, tmp_path_factory):
    """``(arch, safetensors dir, gguf file, transformers model)``."""
    arch = request.param
    hf_dir = tmp_path_factory.mktemp(arch)
    reference = write_tiny_model(hf_dir, CONFIGS[arch]())
    randomise_identity_params(reference)
    reference.save_pretrained(hf_dir, safe_serialization=True)
    path = tmp_path_factory.mktemp(f"{arch}_gguf") / f"tiny-{arch}-f32.gguf"
    write_gguf(hf_dir, path, arch, reference.config)
    return arch, hf_dir, path, reference


def test_gguf_greedy_ids_equal_safetensors_and_transformers(converted):
    arch, hf_dir, path, reference = converted
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    from_gguf = LLM(str(path), num_blocks=32, prefill_chunk_size=8)
    assert from_gguf.engine.summary["weight_format"] == "gguf"
    assert from_gguf.engine.model_config.architecture == type(reference).__name__
    gguf_ids = [r.outputs[0].token_ids for r in from_gguf.generate(prompts, params)]
    safetensors_ids = [r.outputs[0].token_ids for r in LLM(str(hf_dir), num_blocks=32).generate(prompts, params)]
    assert gguf_ids == safetensors_ids
    assert gguf_ids == [reference_greedy(reference, p, STEPS) for p in PROMPTS]


def test_gguf_config_states_the_variant(converted):
    arch, _, path, reference = converted
    from fw_gguf.format import GGUFFormat

    config = GGUFFormat(path.parent, path.name).hf_config()
    expected = reference.config.to_dict()
    rebuilt = transformers.AutoConfig.for_model(**config).to_dict()
    for key in (
        "head_dim",
        "partial_rotary_factor",
        "use_qkv_bias",
        "qk_layernorm",
        "use_parallel_residual",
        "original_max_position_embeddings",
        "layer_norm_eps",
        "rms_norm_eps",
    ):
        if key in expected:
            assert rebuilt.get(key) == pytest.approx(expected[key]), key
    if arch == "phi3":
        rope = rebuilt["rope_parameters"]
        assert rope["rope_type"] == "longrope"  # factors stored as float32 tensors, as transformers computes with them
        assert (rope["short_factor"], rope["long_factor"]) == (pytest.approx(SHORT), pytest.approx(LONG))


@pytest.mark.parametrize("arch", ["phi3", "glm4"])
def test_q8_0_fused_layers_kept_packed_match_transformers_on_the_dequantized_weights(
    arch, tmp_path, monkeypatch, check_kept_packed
):
    """Q8_0 matrices, kept packed and dequantized inside the matmul (the GPU path), including
    the fused qkv / gate_up tensors split into shards: the logits equal transformers' on the
    same model with every matrix replaced by its Q8_0 round trip, and every matrix of the engine
    that computed them is Q8_0 blocks only (a loader that dequantized would fail)."""
    from framework.testing import check_logits_parity

    reference = write_tiny_model(tmp_path / "hf", CONFIGS[arch]())
    randomise_identity_params(reference)
    reference.save_pretrained(tmp_path / "hf", safe_serialization=True)
    path = tmp_path / f"tiny-{arch}-q8_0.gguf"
    write_gguf(tmp_path / "hf", path, arch, reference.config, gguf.GGMLQuantizationType.Q8_0)
    q8 = gguf.GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if param.dim() == 2 and "norm" not in name:
                packed = gguf.quants.quantize(param.numpy(), q8)
                param.copy_(torch.from_numpy(gguf.quants.dequantize(packed, q8)))
    monkeypatch.setenv("FW_GGUF_KEEP_PACKED", "1")
    model = check_logits_parity(path, reference, PROMPTS).engine.core.runner.model
    packed = check_kept_packed(model, q8)
    linear = [name for name, module in model.named_modules() if getattr(module, "linear_method", None) is not None]
    assert packed == linear  # every matrix layer, none left unquantized
    layers = reference.config.num_hidden_layers
    for part in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        assert [name for name in packed if name.endswith(part)] == [f"model.layers.{i}.{part}" for i in range(layers)]
    assert "model.embed_tokens" in packed
