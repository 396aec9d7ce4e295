"""Write a random-weight gpt-oss checkpoint with MXFP4 experts (gpt-oss's own layout), for ``fw bench``.

    python benchmarks/random_mxfp4_checkpoint.py --shape gpt-oss-20b --dir /tmp/gpt-oss-20b-mxfp4
    fw bench --m /tmp/gpt-oss-20b-mxfp4 --num-prompts 1 --input-len 128 --output-len 256
    fw bench --m /tmp/gpt-oss-20b-mxfp4 --num-prompts 64 --input-len 128 --output-len 256

Names and shapes are transformers' for the shape (built on the meta device); each expert stack is
written as gpt-oss ships it: ``gate_up_proj_blocks [E, 2I, H/32, 16]`` / ``_scales [E, 2I, H/32]``
(random e2m1 bytes, e8m0 scales around 2^-7), ``down_proj_blocks`` / ``_scales`` likewise, biases
in bf16; everything else is normal(0, 0.02) in bf16 (norms 1), with ``quant_method: mxfp4``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from common import SHAPES, model_config
from random_quantized_checkpoint import hf_shapes, random_bf16, write_checkpoint_folder

#: What gpt-oss's config.json leaves in bf16.
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
#: e8m0 scale bytes are drawn from 127 - 9 .. 127 - 6: weights of about 1e-2.
SCALE_BYTES = (118, 122)


def mxfp4_tensors(name: str, shape: torch.Size, device: str, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The ``_blocks`` / ``_scales`` of one expert stack (``gate_up_proj [E, H, 2I]`` or ``down_proj [E, I, H]``)."""
    experts, k, rows = shape  # transformers keeps them [E, in, out]
    blocks = torch.randint(0, 256, (experts, rows, k // 32, 16), dtype=torch.uint8, device=device, generator=generator)
    scales = torch.randint(
        *SCALE_BYTES, (experts, rows, k // 32), dtype=torch.uint8, device=device, generator=generator
    )
    return {f"{name}_blocks": blocks.cpu(), f"{name}_scales": scales.cpu()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="gpt-oss-20b", choices=[s for s in SHAPES if "gpt-oss" in s])
    parser.add_argument("--dir", required=True, type=Path)
    args = parser.parse_args()
    config = model_config(args.shape)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    config["torch_dtype"] = "bfloat16"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device).manual_seed(0)

    def tensors():
        for name, shape in hf_shapes(config).items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                yield from mxfp4_tensors(name, shape, device, generator).items()
            else:
                yield name, random_bf16(name, shape, device, generator)

    files = write_checkpoint_folder(args.dir, config, tensors())
    print(
        f"wrote {args.dir}: {args.shape} with MXFP4 experts, {len(files)} shards\n"
        f"run: fw bench --m {args.dir} --num-prompts 1 --input-len 128 --output-len 256"
    )


if __name__ == "__main__":
    main()
