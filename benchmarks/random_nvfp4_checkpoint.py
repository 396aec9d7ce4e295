"""Write a random-weight FP4 checkpoint of a benchmark shape (NVFP4: modelopt or compressed-tensors; compressed-tensors MXFP4).

    python benchmarks/random_nvfp4_checkpoint.py --shape llama3-8b --dir /tmp/llama3-8b-nvfp4
    python benchmarks/random_nvfp4_checkpoint.py --shape llama3-8b --layout compressed-tensors --dir /tmp/llama3-8b-nvfp4-ct
    python benchmarks/gpu_suite.py --m /tmp/llama3-8b-nvfp4 --cases decode:1:128:256 decode:64:128:128 prefill:512
    python benchmarks/random_nvfp4_checkpoint.py --shape qwen3-30b-a3b --dir /tmp/qwen3-30b-a3b-nvfp4
    python benchmarks/random_nvfp4_checkpoint.py --shape qwen3-30b-a3b --layout compressed-tensors-mxfp4 --dir /tmp/qwen3-30b-a3b-mxfp4
    python benchmarks/gpu_suite.py --m /tmp/qwen3-30b-a3b-nvfp4 --cases decode:1:128:256 decode:64:128:128 prefill:512
    python benchmarks/random_nvfp4_checkpoint.py --tiny --dir /tmp/tiny-nvfp4   # the script itself, on a CPU
    python benchmarks/random_nvfp4_checkpoint.py --shape tiny-moe --dir /tmp/tiny-moe-nvfp4

Names and shapes are transformers' for the shape (built on the meta device). Every decoder linear
layer is NVFP4 as the layout ships it: random e2m1 bytes ``[N, K/2]``, e4m3 scales ``[N, K/16]``
drawn in 64..128 and a global scale of 1e-4 (modelopt's ``weight_scale_2`` multiplies;
compressed-tensors' ``weight_global_scale`` = 1e4 divides): weights of about 1e-2. MXFP4
(``compressed-tensors-mxfp4``): random e2m1 bytes and e8m0 scale bytes ``[N, K/32]`` around 2^-7.
MoE experts are written one tensor set per expert, as released checkpoints are
(``mlp.experts.N.gate_proj.weight_packed`` ...); the routers (``mlp.gate``) stay bf16 and are
listed as ignored. Everything else is normal(0, 0.02) in bf16 (norms 1).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from common import SHAPES, model_config
from random_quantized_checkpoint import LINEAR_LEAVES, expand_experts, hf_shapes, random_bf16, write_checkpoint_folder

GLOBAL_SCALE = 1e-4
LAYOUTS = ("modelopt", "compressed-tensors", "compressed-tensors-mxfp4")
#: MXFP4's e8m0 scale bytes are drawn from 127 - 9 .. 127 - 6: weights of about 1e-2.
MXFP4_SCALE_BYTES = (118, 122)


def quantization_config(layout: str) -> dict:
    """``config.json``'s ``quantization_config`` of a checkpoint in ``layout`` (``lm_head`` and the MoE
    routers in bf16)."""
    if layout == "modelopt":
        return {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "group_size": 16,
            "exclude_modules": ["lm_head", "model.layers.*.mlp.gate"],
        }
    mxfp4 = layout == "compressed-tensors-mxfp4"
    weights = {
        "num_bits": 4,
        "type": "float",
        "group_size": 32 if mxfp4 else 16,
        "strategy": "group" if mxfp4 else "tensor_group",
        "symmetric": True,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized" if mxfp4 else "nvfp4-pack-quantized",
        "ignore": ["lm_head", "re:.*mlp[.]gate$"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
    }


def nvfp4_tensors(n: int, k: int, layout: str, device: str, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """One linear weight ``[n, k]``'s tensors, named as ``layout`` names them (without the module prefix)."""
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device, generator=generator).cpu()
    if layout == "compressed-tensors-mxfp4":
        low, high = MXFP4_SCALE_BYTES
        scale_bytes = torch.randint(low, high + 1, (n, k // 32), dtype=torch.uint8, device=device, generator=generator)
        return {"weight_packed": packed, "weight_scale": scale_bytes.cpu()}
    scales = (64 + 64 * torch.rand(n, k // 16, device=device, generator=generator)).to(torch.float8_e4m3fn).cpu()
    if layout == "modelopt":
        return {
            "weight": packed,
            "weight_scale": scales,
            "weight_scale_2": torch.tensor(GLOBAL_SCALE),
            "input_scale": torch.tensor(1.0),
        }
    return {
        "weight_packed": packed,
        "weight_scale": scales,
        "weight_global_scale": torch.tensor([1 / GLOBAL_SCALE]),
        "input_global_scale": torch.tensor([1.0]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--layout", default="modelopt", choices=LAYOUTS)
    parser.add_argument("--tiny", action="store_true", help="the tiny shape (checks the script on a CPU)")
    parser.add_argument("--dir", required=True, type=Path)
    args = parser.parse_args()
    shape = "tiny" if args.tiny else args.shape
    config = model_config(shape)
    config["quantization_config"] = quantization_config(args.layout)
    config["torch_dtype"] = "bfloat16"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device).manual_seed(0)

    def tensors():
        for name, shape_ in hf_shapes(config).items():
            linears = {}
            if ".experts." in name and len(shape_) == 3:  # transformers' stacks: one tensor set per expert
                linears = expand_experts(name, shape_)
            elif name.endswith(".weight") and ".layers." in name and name.rsplit(".", 2)[-2] in LINEAR_LEAVES:
                linears = {name: tuple(shape_)}
            if not linears:
                yield name, random_bf16(name, shape_, device, generator)
            for linear, (n, k) in linears.items():
                for key, value in nvfp4_tensors(n, k, args.layout, device, generator).items():
                    yield f"{linear.removesuffix('.weight')}.{key}", value

    files = write_checkpoint_folder(args.dir, config, tensors())
    print(
        f"wrote {args.dir}: {shape}, FP4 ({args.layout}), {len(files)} shards\n"
        f"run: python benchmarks/gpu_suite.py --m {args.dir} --cases decode:1:128:256 decode:64:128:128 prefill:512"
    )


if __name__ == "__main__":
    main()
