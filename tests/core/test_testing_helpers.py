"""The plugin-author helpers of ``framework.testing`` that write tiny checkpoints."""

from __future__ import annotations

import torch
import transformers
from safetensors.torch import load_file

from framework.testing import write_randomised_model

TINY = transformers.LlamaConfig(
    vocab_size=32,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=64,
    attention_bias=True,
)


def test_randomised_model_is_written_once_with_its_random_norms_and_biases(tmp_path, monkeypatch):
    saves = []
    original = transformers.PreTrainedModel.save_pretrained

    def counting_save(self, *args, **kwargs):
        saves.append(args[0] if args else kwargs.get("save_directory"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", counting_save)
    reference = write_randomised_model(tmp_path, TINY)
    assert len(saves) == 1
    stored = load_file(tmp_path / "model.safetensors")
    norm, bias = "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_proj.bias"
    assert not torch.equal(stored[norm], torch.ones_like(stored[norm]))  # randomised before the write
    assert stored[bias].abs().sum() > 0
    for name, tensor in reference.state_dict().items():
        if name in stored:
            assert torch.equal(stored[name], tensor), name


def test_the_testing_package_re_exports_every_public_helper_of_its_modules():
    """``from framework.testing import X`` keeps working for every helper, whichever module holds it
    (the quant kits, which import torch, through a lazy attribute: their three entry points)."""
    import importlib
    import inspect
    import pkgutil

    import framework.testing as testing

    missing = []
    for info in pkgutil.iter_modules(testing.__path__):
        if info.name == "quant":
            assert all(getattr(testing, name) is not None for name in ("QuantScheme", "check_linear_method"))
            continue
        module = importlib.import_module(f"framework.testing.{info.name}")
        for name, value in vars(module).items():
            defined_here = getattr(value, "__module__", module.__name__) == module.__name__ or not (
                inspect.isfunction(value) or inspect.isclass(value) or inspect.ismodule(value)
            )
            if name.startswith("_") or inspect.ismodule(value) or not defined_here or name == "annotations":
                continue
            if name not in testing.__all__ or getattr(testing, name) is not value:
                missing.append(f"{info.name}.{name}")
    assert not missing, missing
