"""Time to first token with an image and decode speed of a vision model on random weights (GPU machine).

    python benchmarks/vision_prefill.py --shape qwen2.5-vl-7b --size 1024 --out $OUT/vision-qwen2.5-vl-7b.json
    python benchmarks/vision_prefill.py --shape tiny-vl --size 112 --device cpu --dtype float32   # checks the script

For each repeat a new random ``size`` x ``size`` image (so the prefix cache never hits) goes into a
prompt of ``--text`` tokens before and after it, preprocessed with Qwen2-VL's default processor
(``max_pixels`` 28*28*1280: a 1024 x 1024 image becomes 980 x 980, 1225 image tokens). It times,
with the device synchronised: the vision tower alone on that image (``encoder_ms``), the whole
first step from ``add_request`` to the first token read back (``ttft_ms``: encoder, prefill of
every prompt token, sampling), then ``--steps`` decode steps (``decode_tokens_per_s``, from the
median step interval). Writes the JSON with the date, device, commit and command.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from common import (
    add_engine_arguments,
    engine_kwargs,
    report_header,
    run_engine_script,
    synchronize,
    write_model_folder,
)

VISION_7B = dict(
    depth=32,
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    out_hidden_size=3584,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31],
    tokens_per_second=2,
    hidden_act="silu",
)
SHAPES = {
    # Qwen2.5-VL-7B-Instruct's config.json (text keys at the top level, as the Hub checkpoint has them)
    "qwen2.5-vl-7b": dict(
        architectures=["Qwen2_5_VLForConditionalGeneration"],
        model_type="qwen2_5_vl",
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        max_position_embeddings=128000,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
        image_token_id=151655,
        video_token_id=151656,
        vision_start_token_id=151652,
        vision_end_token_id=151653,
        vision_config=VISION_7B,
    ),
    "tiny-vl": dict(
        architectures=["Qwen2_5_VLForConditionalGeneration"],
        model_type="qwen2_5_vl",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        max_position_embeddings=4096,
        rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
        image_token_id=294,
        video_token_id=295,
        vision_start_token_id=292,
        vision_end_token_id=293,
        vision_config={
            **VISION_7B,
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 64,
            "fullatt_block_indexes": [1],
        },
    ),
}


def prompt_with_image(llm, size: int, text: int, seed: int):
    """Prompt ids with ``text`` tokens on each side of a random image, and the image's input."""
    from framework.multimodal.inputs import load_processor
    from framework.multimodal.prompt import expand_placeholders
    from framework.testing import random_image

    vision = llm.engine.vision
    processed = load_processor(vision).preprocess(random_image(size, size, seed))
    generator = torch.Generator().manual_seed(seed)
    words = torch.randint(10, min(1000, vision.image_token_id - 10), (2 * text,), generator=generator).tolist()
    ids, images = expand_placeholders(
        [*words[:text], vision.image_token_id, *words[text:]], [processed], vision.image_token_id
    )
    return ids, images, processed


def run(llm, args) -> dict:
    from framework import SamplingParams

    core, model = llm.engine.core, llm.engine.core.runner.model
    params = SamplingParams(temperature=0, max_tokens=args.steps + 1, ignore_eos=True)
    encoder_ms, ttft_ms, intervals = [], [], []
    num_tokens = 0
    for repeat in range(args.repeats + 1):  # the first repeat warms up (kernels, allocator)
        ids, images, processed = prompt_with_image(llm, args.size, args.text, repeat)
        pixels = torch.from_numpy(processed.pixel_values).to(core.runner.device)
        synchronize()
        started = time.perf_counter()
        with torch.inference_mode():
            model.embed_image(pixels, processed.grid)
        synchronize()
        encoder = time.perf_counter() - started
        started = time.perf_counter()
        core.add_request(f"r{repeat}", ids, params, images=images)
        while not any(out.new_token_ids for out in core.step()):
            pass
        first = time.perf_counter() - started
        last, steps = time.perf_counter(), []
        while core.has_unfinished():
            core.step()
            now = time.perf_counter()
            steps.append(now - last)
            last = now
        if repeat:
            encoder_ms.append(encoder * 1e3)
            ttft_ms.append(first * 1e3)
            intervals += steps[2:]  # past the first steps of the async pipeline
        num_tokens = len(ids)
    return {
        "image_size": args.size,
        "image_tokens": processed.num_tokens,
        "prompt_tokens": num_tokens,
        "encoder_ms": statistics.median(encoder_ms),
        "ttft_ms": statistics.median(ttft_ms),
        "ttft_ms_all": ttft_ms,
        "decode_tokens_per_s": 1.0 / statistics.median(intervals),
        "decode_steps": args.steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen2.5-vl-7b", choices=sorted(SHAPES))
    parser.add_argument("--size", type=int, default=1024, help="the image's side in pixels")
    parser.add_argument("--text", type=int, default=16, help="text tokens before and after the image")
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed after the first token")
    parser.add_argument("--repeats", type=int, default=5)
    add_engine_arguments(parser)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from framework import LLM

    folder = write_model_folder(SHAPES[args.shape])
    max_model_len = min(8192, SHAPES[args.shape]["max_position_embeddings"])
    llm = LLM(**engine_kwargs(args, model=str(folder), load_format="dummy", max_model_len=max_model_len))
    result = {**report_header(), "model": f"{args.shape} shape, random weights", "dtype": args.dtype, **run(llm, args)}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    run_engine_script(main)
