"""Write a random-weight NVFP4 checkpoint of a dense benchmark shape (modelopt or compressed-tensors layout).

    python benchmarks/random_nvfp4_checkpoint.py --shape llama3-8b --dir /tmp/llama3-8b-nvfp4
    python benchmarks/random_nvfp4_checkpoint.py --shape llama3-8b --layout compressed-tensors --dir /tmp/llama3-8b-nvfp4-ct
    python benchmarks/gpu_suite.py --m /tmp/llama3-8b-nvfp4 --cases decode:1:128:256 decode:64:128:128 prefill:512
    python benchmarks/random_nvfp4_checkpoint.py --tiny --dir /tmp/tiny-nvfp4   # the script itself, on a CPU

Names and shapes are transformers' for the shape (built on the meta device). Every decoder linear
layer is NVFP4 as the layout ships it: random e2m1 bytes ``[N, K/2]``, e4m3 scales ``[N, K/16]``
drawn in 64..128 and a global scale of 1e-4 (modelopt's ``weight_scale_2`` multiplies;
compressed-tensors' ``weight_global_scale`` = 1e4 divides): weights of about 1e-2. Everything else
is normal(0, 0.02) in bf16 (norms 1). Shapes with MoE experts are refused (NVFP4 experts are not
built in fw yet).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from common import SHAPES, model_config
from random_quantized_checkpoint import LINEAR_LEAVES, hf_shapes, random_bf16, write_checkpoint_folder

GLOBAL_SCALE = 1e-4
LAYOUTS = ("modelopt", "compressed-tensors")


def quantization_config(layout: str) -> dict:
    """``config.json``'s ``quantization_config`` of an NVFP4 checkpoint in ``layout`` (``lm_head`` in bf16)."""
    if layout == "modelopt":
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}
    weights = {"num_bits": 4, "type": "float", "group_size": 16, "strategy": "tensor_group", "symmetric": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
    }


def nvfp4_tensors(n: int, k: int, layout: str, device: str, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """One linear weight ``[n, k]``'s tensors, named as ``layout`` names them (without the module prefix)."""
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device, generator=generator).cpu()
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
    if any(key in config for key in ("num_experts", "num_local_experts", "n_routed_experts")):
        parser.error(f"--shape {shape} has MoE experts; NVFP4 experts are not built yet: choose a dense shape")
    config["quantization_config"] = quantization_config(args.layout)
    config["torch_dtype"] = "bfloat16"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device).manual_seed(0)

    def tensors():
        for name, shape_ in hf_shapes(config).items():
            if name.endswith(".weight") and ".layers." in name and name.rsplit(".", 2)[-2] in LINEAR_LEAVES:
                n, k = shape_
                for key, value in nvfp4_tensors(n, k, args.layout, device, generator).items():
                    yield f"{name.removesuffix('.weight')}.{key}", value
            else:
                yield name, random_bf16(name, shape_, device, generator)

    files = write_checkpoint_folder(args.dir, config, tensors())
    print(
        f"wrote {args.dir}: {shape}, NVFP4 ({args.layout}), {len(files)} shards\n"
        f"run: python benchmarks/gpu_suite.py --m {args.dir} --cases decode:1:128:256 decode:64:128:128 prefill:512"
    )


if __name__ == "__main__":
    main()
