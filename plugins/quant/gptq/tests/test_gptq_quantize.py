"""``fw quantize``: GPTQ lowers the calibration error below round-to-nearest (its whole point), the
three methods write checkpoints whose greedy tokens through the engine equal transformers' on the
checkpoint's dequantized weights, and bad settings are refused before the model is read."""

from __future__ import annotations

import pytest
import torch
import transformers
from fw_gptq.packing import unpack_awq, unpack_compressed, unpack_gptq
from fw_gptq.quantize.cli import default_calibration_text
from fw_gptq.quantize.gptq import gptq_quantize
from fw_gptq.quantize.rtn import round_to_nearest
from fw_gptq.quantize.run import QuantizeJob, run_quantize
from safetensors.torch import load_file
from typer.testing import CliRunner

from framework import LLM, SamplingParams
from framework.testing import reference_greedy, write_tiny_model

CONFIG = dict(
    vocab_size=160,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,
)
PROMPTS = [[5, 9, 33, 2, 71], list(range(40, 59))]


def correlated_inputs(rows: int, k: int, generator: torch.Generator) -> torch.Tensor:
    mixing = torch.randn(k, k, generator=generator) / k**0.5
    scales = torch.logspace(-1, 1, k)[torch.randperm(k, generator=generator)]  # some channels matter more
    return (torch.randn(rows, k, generator=generator) @ mixing) * scales


@pytest.mark.parametrize(
    ("bits", "group", "symmetric", "act_order"), [(4, 128, True, False), (4, 32, False, True), (8, -1, True, False)]
)
def test_gptq_output_error_on_calibration_inputs_is_below_round_to_nearest(bits, group, symmetric, act_order):
    generator = torch.Generator().manual_seed(0)
    x = correlated_inputs(1024, 256, generator)
    w = torch.randn(64, 256, generator=generator) * 0.05
    gptq = gptq_quantize(w, x.t() @ x, bits, group, symmetric, act_order)
    rtn = round_to_nearest(w, bits, group, symmetric)
    error = lambda q: float(((x @ (q.dequantize() - w).t()) ** 2).mean())  # noqa: E731
    assert error(gptq) < 0.8 * error(rtn)
    if act_order:
        assert gptq.g_idx is not None and torch.equal(torch.bincount(gptq.g_idx), torch.full((256 // group,), group))


def dequantized_reference(src, dst, method):
    """transformers' model of ``src`` with every tensor of the checkpoint at ``dst`` (packed ones decoded)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager")
    tensors = load_file(str(dst / "model.safetensors"))
    state = model.state_dict()
    decoded = {}
    for name in tensors:
        stem, _, leaf = name.rpartition(".")
        if method == "gptq" and leaf == "qweight":
            decoded[f"{stem}.weight"] = unpack_gptq(
                tensors[name], tensors[f"{stem}.qzeros"], tensors[f"{stem}.scales"], None, 4, 128, 1
            ).dequantize()
        elif method == "awq" and leaf == "qweight":
            decoded[f"{stem}.weight"] = unpack_awq(
                tensors[name], tensors[f"{stem}.qzeros"], tensors[f"{stem}.scales"], 128
            ).dequantize()
        elif method == "rtn" and leaf == "weight_packed":
            decoded[f"{stem}.weight"] = unpack_compressed(
                tensors[name], tensors[f"{stem}.weight_scale"], None, None, 4, 128
            ).dequantize()
        elif name in state:
            decoded[name] = tensors[name].float()
    with torch.no_grad():
        for name, value in decoded.items():
            state[name].copy_(value)
    assert sum(n.endswith("proj.weight") for n in decoded) == 14  # every decoder linear layer came from the file
    return model


@pytest.mark.parametrize("method", ["gptq", "awq", "rtn"])
def test_quantized_checkpoint_runs_in_the_engine_as_transformers_runs_its_values(method, tmp_path):
    write_tiny_model(tmp_path / "src", transformers.LlamaConfig(**CONFIG))
    job = QuantizeJob(
        tmp_path / "src",
        tmp_path / "dst",
        method,
        4,
        128,
        None,
        False,
        default_calibration_text(),
        num_samples=4,
        seq_len=64,
    )
    run_quantize(job, echo=lambda _: None)
    reference = dequantized_reference(tmp_path / "src", tmp_path / "dst", method)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(str(tmp_path / "dst"), device="cpu", dtype="float32", num_blocks=16) as llm:
        method_name = type(llm.engine.core.runner.model.model.layers[0].mlp.down_proj.linear_method).__name__
        results = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert method_name == "WNA16LinearMethod"
    assert [r.outputs[0].token_ids for r in results] == [reference_greedy(reference, p, 8) for p in PROMPTS]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--method", "awq", "--bits", "8"], "8-bit weights are not supported; supported bits: 4"),
        (["--group-size", "100"], "group size 100 is not supported"),
        (["--method", "rtn", "--desc-act"], "--desc-act is a GPTQ setting"),
        (["--method", "squeeze"], "unknown method 'squeeze'; valid: gptq, awq, rtn"),
    ],
)
def test_bad_settings_fail_before_the_model_is_read(args, message, tmp_path):
    from cli.main import build_app

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text("{}")  # never read: the settings are checked first
    result = CliRunner().invoke(build_app(), ["quantize", str(tmp_path / "src"), str(tmp_path / "dst"), *args])
    assert result.exit_code == 2
    assert message in result.output
