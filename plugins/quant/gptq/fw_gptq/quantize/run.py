"""The quantization job behind ``fw quantize``: load the source with transformers, calibrate,
quantize every decoder linear layer (with a progress bar), write the checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from framework.errors import ConfigError

from ..config import ROUTER_LEAVES, check_bits_and_group
from ..packing import IntWeight
from .writer import quantization_config, write_checkpoint


@dataclass(slots=True)
class QuantizeJob:
    src: Path
    dst: Path
    method: str
    bits: int
    group_size: int
    symmetric: bool | None
    desc_act: bool
    calibration_text: str
    num_samples: int = 32
    seq_len: int = 256

    def check(self) -> None:
        """Refuse settings the written checkpoint could not hold, before loading anything."""
        if self.method not in ("gptq", "awq", "rtn"):
            raise ConfigError(f"unknown method {self.method!r}; valid: gptq, awq, rtn")
        check_bits_and_group(
            f"fw quantize --method {self.method}",
            self.bits,
            self.group_size,
            valid_bits=(4,) if self.method == "awq" else (4, 8),
        )
        if self.desc_act and self.method != "gptq":
            raise ConfigError("--desc-act is a GPTQ setting; use it with --method gptq")
        if not (self.src / "config.json").exists():
            raise ConfigError(f"{self.src}: expected a Hugging Face model directory with config.json")
        if self.symmetric is None:
            self.symmetric = self.method != "awq"


def decoder_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The decoder layers' linear layers by checkpoint prefix (routers excluded); refuses MoE experts,
    which transformers keeps as fused tensors this command does not quantize yet."""
    linears = {}
    for name, module in model.named_modules():
        if ".experts" in name or type(module).__name__.endswith(("Experts", "SparseMoeBlock")):
            raise ConfigError("fw quantize does not quantize mixture-of-experts models yet")
        if isinstance(module, nn.Linear) and ".layers." in f".{name}" and name.rpartition(".")[2] not in ROUTER_LEAVES:
            linears[name] = module
    return linears


def run_quantize(job: QuantizeJob, echo: Callable[[str], None] = print) -> list[Path]:
    """Run ``job``; returns the safetensors files written."""
    import transformers
    from tqdm import tqdm

    from .awq import fold_scale, scaling_groups, search_scale
    from .calibrate import calibration_chunks, collect_input_stats
    from .gptq import gptq_quantize
    from .rtn import round_to_nearest

    job.check()
    config = transformers.AutoConfig.from_pretrained(job.src)
    out_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.bfloat16
    out_dtype = getattr(torch, out_dtype) if isinstance(out_dtype, str) else out_dtype
    if out_dtype == torch.float32:
        out_dtype = torch.bfloat16
    model = transformers.AutoModelForCausalLM.from_pretrained(job.src, dtype=torch.float32).eval()
    linears = decoder_linears(model)
    stats = None
    if job.method in ("gptq", "awq"):
        tokenizer = transformers.AutoTokenizer.from_pretrained(job.src)
        chunks = calibration_chunks(tokenizer, job.calibration_text, job.num_samples, job.seq_len)
        with tqdm(total=len(chunks), desc="calibrating", unit="window") as bar:
            stats = collect_input_stats(model, linears, chunks, job.method == "gptq", progress=bar.update)
    if job.method == "awq":
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        offset = 1.0 if "gemma" in config.model_type else 0.0
        for index, layer in enumerate(tqdm(decoder.layers, desc="awq scales", unit="layer")):
            for previous, names in scaling_groups(layer):
                full = [f"model.layers.{index}.{n}" for n in names]
                scale = search_scale(
                    [linears[n].weight.data for n in full], stats[full[0]], job.bits, job.group_size, job.symmetric
                )
                fold_scale(previous, [linears[n] for n in full], scale, offset)
    quantized: dict[str, IntWeight] = {}
    for name, linear in tqdm(linears.items(), desc=f"{job.method} {job.bits}-bit", unit="layer"):
        w = linear.weight.data.float()
        if job.method == "gptq":
            quantized[name] = gptq_quantize(
                w, stats[name].hessian, job.bits, job.group_size, job.symmetric, job.desc_act
            )
        else:
            quantized[name] = round_to_nearest(w, job.bits, job.group_size, job.symmetric)
    tensors = dict(model.state_dict())
    if getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    fmt = {"gptq": "gptq", "awq": "awq", "rtn": "compressed-tensors"}[job.method]
    update = {"quantization_config": quantization_config(fmt, job.bits, job.group_size, job.symmetric, job.desc_act)}
    echo(f"writing {len(quantized)} quantized layers to {job.dst}")
    return write_checkpoint(job.src, job.dst, tensors, quantized, fmt, update, out_dtype)
