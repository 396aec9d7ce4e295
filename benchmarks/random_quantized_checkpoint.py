"""Write a random-weight GPTQ / AWQ / compressed-tensors / FP8 checkpoint of a benchmark shape, for ``fw bench``.

    python benchmarks/random_quantized_checkpoint.py --shape llama3-8b --dir /tmp/llama3-8b-gptq
    fw bench --m /tmp/llama3-8b-gptq --num-prompts 1 --input-len 128 --output-len 256
    python benchmarks/random_quantized_checkpoint.py --shape llama3-8b --desc-act --dir /tmp/llama3-8b-gptq-act
    python benchmarks/random_quantized_checkpoint.py --shape qwen3-30b-a3b --dir /tmp/qwen3-moe-gptq
    python benchmarks/random_quantized_checkpoint.py --shape llama3-8b --method fp8 --dir /tmp/llama3-8b-fp8
    python benchmarks/random_quantized_checkpoint.py --shape llama3-8b --method fp8-tensor --dir /tmp/llama3-8b-fp8t
    python benchmarks/random_quantized_checkpoint.py --shape llama3-8b --method bf16 --dir /tmp/llama3-8b-bf16  # for --isq

The names and shapes are transformers' for the shape (built on the meta device, as the ``dummy``
load format does); every decoder linear layer (MoE experts as ``experts.{e}.gate_proj`` ...) gets
random packed integers with its format's tensors (:mod:`fw_gptq.params`), scales of about 1e-3 and
symmetric zero points (``fp8``: Hugging Face block FP8, normal(0, 0.02) weights quantized per 128x128
block by ``fw_fp8.quantize``; ``fp8-tensor``: one scale per tensor; ``bf16``: no quantization, the
source of ``--isq`` runs); the rest is normal(0, 0.02) in bf16 (norms 1). A word-level tokenizer of the
vocabulary makes the folder loadable. Tensors are drawn on the GPU when there is one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from common import SHAPES, model_config
from fw_gptq.config import ROUTER_LEAVES, WNA16Scheme
from fw_gptq.params import checkpoint_params
from fw_gptq.quantize.writer import quantization_config
from safetensors.torch import save_file

from framework.testing import make_tiny_tokenizer

LINEAR_LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FORMATS = {
    "bf16": None,
    "gptq": "gptq",
    "awq": "awq",
    "compressed-tensors": "compressed",
    "fp8": "fp8",
    "fp8-tensor": "fp8",
}


def random_fp8(n: int, k: int, per_tensor: bool, device: str, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """An FP8 weight of normal(0, 0.02) values in the HF layout: block scales, or one per tensor."""
    from fw_fp8.quantize import FP8_DTYPE, FP8_MAX, quantize_weight_fp8

    weight = torch.empty(n, k, device=device).normal_(0, 0.02, generator=generator)
    if per_tensor:
        scale = weight.abs().max() / FP8_MAX
        return {"weight": (weight / scale).to(FP8_DTYPE).cpu(), "weight_scale": scale.reshape(1).cpu()}
    q, scale = quantize_weight_fp8(weight)
    return {"weight": q.cpu(), "weight_scale_inv": scale.cpu()}


def hf_shapes(config: dict) -> dict[str, torch.Size]:
    import transformers

    hf_config = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    return {name: tensor.shape for name, tensor in model.state_dict().items()}


def expand_experts(name: str, shape: torch.Size) -> dict[str, tuple[int, int]]:
    """transformers' fused expert stacks as per-expert ``[out, in]`` linear weights."""
    stem = name.rsplit(".", 1)[0] if name.endswith(".weight") else name
    experts, rows, cols = shape
    if stem.endswith("gate_up_proj"):
        base = stem.removesuffix(".gate_up_proj")
        return {f"{base}.{e}.{p}.weight": (rows // 2, cols) for e in range(experts) for p in ("gate_proj", "up_proj")}
    base = stem.removesuffix(".down_proj")
    return {f"{base}.{e}.down_proj.weight": (rows, cols) for e in range(experts)}


def random_packed(
    scheme: WNA16Scheme, n: int, k: int, device: str, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    tensors = {}
    for spec in checkpoint_params(scheme, k, n, k, "random checkpoint"):
        if spec.unused:
            continue
        if spec.name in ("scales", "weight_scale", "s"):
            value = (1e-3 * (1 + torch.rand(spec.shape, device=device, generator=generator))).to(
                torch.bfloat16 if scheme.format == "compressed" else torch.float16
            )
        elif spec.name in ("g_idx", "weight_g_idx"):
            groups = torch.arange(k, device=device) // scheme.group_size
            value = groups[torch.randperm(k, device=device, generator=generator)] if scheme.desc_act else groups
            value = value.to(torch.int32)
        elif spec.name == "weight_shape":
            value = torch.tensor([n, k], dtype=torch.int64)
        elif spec.name == "qzeros" and scheme.format == "gptq":  # symmetric: every stored zero 2**(bits-1) - 1
            stored = 2 ** (scheme.bits - 1) - 1
            word = sum(stored << (scheme.bits * j) for j in range(scheme.pack_factor))
            value = torch.full(spec.shape, word - 2**32 if word >= 2**31 else word, dtype=torch.int32, device=device)
        else:
            value = torch.randint(
                -(2**31), 2**31 - 1, spec.shape, dtype=torch.int32, device=device, generator=generator
            )
        tensors[spec.name] = value.cpu()
    return tensors


def random_bf16(name: str, shape: torch.Size, device: str, generator: torch.Generator) -> torch.Tensor:
    """An unquantized tensor of a random checkpoint: ones for norms, else normal(0, 0.02), bf16 on the CPU."""
    if "norm" in name:
        return torch.ones(shape, dtype=torch.bfloat16)
    return torch.empty(shape, device=device).normal_(0, 0.02, generator=generator).to(torch.bfloat16).cpu()


def write_checkpoint_folder(directory: Path, config: dict, tensors) -> list[Path]:
    """Save ``(name, tensor)`` pairs in shards of about 2 GiB with their index, ``config`` and a
    word-level tokenizer of its vocabulary: a folder ``fw bench --m`` loads. Returns the shards."""
    directory.mkdir(parents=True, exist_ok=True)
    shard, shard_bytes, files, weight_map = {}, 0, [], {}

    def flush() -> None:
        nonlocal shard, shard_bytes
        path = directory / f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(path), metadata={"format": "pt"})
        files.append(path)
        weight_map.update(dict.fromkeys(shard, path.name))
        shard, shard_bytes = {}, 0

    for name, tensor in tensors:
        shard[name] = tensor
        shard_bytes += tensor.nbytes
        if shard_bytes > 2 * 2**30:
            flush()
    if shard:
        flush()
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    make_tiny_tokenizer(int(config["vocab_size"])).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--method", default="gptq", choices=list(FORMATS))
    parser.add_argument("--bits", type=int, default=4, choices=(4, 8))
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--desc-act", action="store_true")
    parser.add_argument("--dir", required=True, type=Path)
    args = parser.parse_args()
    symmetric = args.method != "awq"
    scheme = WNA16Scheme(
        FORMATS[args.method] if args.method in ("gptq", "awq", "compressed-tensors") else "gptq",
        args.bits,
        args.group_size,
        symmetric,
        args.desc_act,
    )
    config = model_config(args.shape)
    is_fp8 = args.method.startswith("fp8")
    if args.method == "bf16":
        pass
    elif is_fp8:
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
        if args.method == "fp8":
            config["quantization_config"]["weight_block_size"] = [128, 128]
    else:
        config["quantization_config"] = quantization_config(
            args.method, args.bits, args.group_size, symmetric, args.desc_act
        )
    if args.method == "compressed-tensors" and args.desc_act:
        config["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    config["torch_dtype"] = "bfloat16"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device).manual_seed(0)

    def tensors():
        for name, shape in hf_shapes(config).items():
            linears = {}
            if ".experts." in name and len(shape) == 3:
                linears = expand_experts(name, shape)
            elif (
                name.endswith(".weight")
                and name.rsplit(".", 2)[-2] in LINEAR_LEAVES
                and ".layers." in name
                and name.rsplit(".", 2)[-2] not in ROUTER_LEAVES
            ):
                linears = {name: tuple(shape)}
            if args.method == "bf16":
                linears = {}
            if not linears:
                yield name, random_bf16(name, shape, device, generator)
            for linear, (n, k) in linears.items():
                packed = (
                    random_fp8(n, k, args.method == "fp8-tensor", device, generator)
                    if is_fp8
                    else random_packed(scheme, n, k, device, generator)
                )
                for key, value in packed.items():
                    yield f"{linear.removesuffix('.weight')}.{key}", value

    files = write_checkpoint_folder(args.dir, config, tensors())
    print(
        f"wrote {args.dir}: {args.shape}, {args.method}"
        f"{'' if is_fp8 or args.method == 'bf16' else f' {args.bits}-bit group {args.group_size}'}"
        f"{' act-order' if args.desc_act else ''}, {len(files)} shards\n"
        f"run: fw bench --m {args.dir} --num-prompts 1 --input-len 128 --output-len 256"
    )


if __name__ == "__main__":
    main()
