"""The GPU issue's benchmark setups on random weights of real model shapes (run on the GPU machine).

    python benchmarks/gpu_suite.py --shape llama3-8b --attention-backend triton \
        --cases decode:1:4096:1024 decode:1:512:256 decode:64:128:128 prefill:512 --out $OUT/suite.json
    python benchmarks/gpu_suite.py --shape qwen2.5-0.5b --cases nano:256 --out $OUT/nano.json
    python benchmarks/gpu_suite.py --shape deepseek-v2-lite --attention-backend triton \
        --cases decode:1:128:256 decode:64:128:128 --out $OUT/mla.json     # MLA: torch for the before
    python benchmarks/gpu_suite.py --m /tmp/llama3-8b-gptq --cases decode:1:128:256 prefill:512   # a checkpoint

Cases (one engine is built per run, random weights through the model's own loaders):

- ``decode:B:IN:OUT`` — ``B`` requests of ``IN`` random prompt tokens generate ``OUT`` tokens each
  (EOS ignored); after every prompt is processed, the remaining decode steps are timed until the
  last request finishes: ``decode_tokens_per_s`` = tokens generated in that window / its time.
  At batch 1 the fraction of the roofline (weight bytes / copy bandwidth) is reported too.
- ``prefill:IN`` — one prompt of ``IN`` tokens (prefix cache off), median of 5 runs of the whole
  prefill step (forward + first token): ``prefill_tokens_per_s``.
- ``nano:N`` — nano-vllm's offline benchmark: ``N`` requests, input and output lengths uniform in
  100..1024 (seed 0), EOS ignored, all submitted at once: output tokens / wall time.

Every result carries ``device``, ``model``, ``dtype``, ``tp``, ``num_gpus``, ``batch_size``,
``input_len``, ``output_len``, ``decode_tokens_per_s``, ``commit`` and ``command``. ``--tp N`` (or
``--d 0,1``) runs the engine tensor-parallel, as ``decode.py`` does; the roofline then uses one
rank's weight bytes. ``--m FOLDER`` times a checkpoint folder (``random_quantized_checkpoint.py``
writes random GPTQ / AWQ / FP8 ones of the shapes, ``random_nvfp4_checkpoint.py`` NVFP4 ones) instead of the shape's random bf16 weights. On a CPU (``--shape tiny``; ``tiny-mla`` for multi-head latent attention, on the torch backend there) the same cases run, for checking the script.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from common import (
    COPY_BANDWIDTH,
    SHAPES,
    add_engine_arguments,
    add_random_requests,
    bytes_read_per_token,
    engine_kwargs,
    model_config,
    nano_requests,
    prefill_until_decode,
    random_prompt,
    report_header,
    run_engine_script,
    synchronize,
    tensor_parallel_size,
    write_model_folder,
)


def run_decode(llm, batch: int, input_len: int, output_len: int) -> dict:
    from framework import SamplingParams
    from framework.engine.request import PLACEHOLDER

    core = llm.engine.core
    generator = torch.Generator().manual_seed(batch * 7919 + input_len)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    add_random_requests(llm, f"d{batch}-{input_len}", batch, input_len, params, generator)
    prefill_until_decode(core)  # early requests already decode
    # tokens already produced (a placeholder is a token of the step still in flight: not yet done)
    done_before = sum(r.num_output_tokens - r.output_token_ids.count(PLACEHOLDER) for r in core.requests.values())
    finished_before = batch - len(core.requests)
    synchronize()
    started = time.perf_counter()
    steps = 0
    while core.requests:
        core.step()
        steps += 1
    elapsed = time.perf_counter() - started
    tokens = (batch - finished_before) * output_len - done_before
    return {
        "case": "decode",
        "batch_size": batch,
        "input_len": input_len,
        "output_len": output_len,
        "decode_steps": steps,
        "decode_s": elapsed,
        "decode_tokens_per_s": tokens / elapsed,
    }


def run_prefill(llm, input_len: int, repeats: int = 5) -> dict:
    from framework import SamplingParams

    core, vocab = llm.engine.core, llm.engine.model_config.vocab_size
    generator = torch.Generator().manual_seed(input_len)
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    times = []
    for i in range(repeats + 1):
        core.add_request(f"p{input_len}-{i}", random_prompt(vocab, input_len, generator), params)
        synchronize()
        started = time.perf_counter()
        while core.requests:
            core.step()
        if i:  # the first run warms up this prompt length
            times.append(time.perf_counter() - started)
    step = statistics.median(times)
    return {
        "case": "prefill",
        "batch_size": 1,
        "input_len": input_len,
        "output_len": 1,
        "prefill_s": step,
        "prefill_tokens_per_s": input_len / step,
        "decode_tokens_per_s": None,
    }


def run_nano(llm, num_requests: int) -> dict:
    """nano-vllm's bench.py: lengths uniform in 100..1024, seed 0, all requests at once."""
    from framework import SamplingParams

    prompts, output_lens = nano_requests(num_requests, llm.engine.model_config.vocab_size)
    params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True) for n in output_lens]
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - started
    out_tokens = sum(len(r.outputs[0].token_ids) for r in outputs)
    return {
        "case": "nano-vllm",
        "batch_size": num_requests,
        "input_len": "uniform 100..1024",
        "output_len": "uniform 100..1024",
        "input_tokens": sum(len(p["prompt_token_ids"]) for p in prompts),
        "output_tokens": out_tokens,
        "elapsed_s": elapsed,
        "decode_tokens_per_s": out_tokens / elapsed,
        "output_tokens_per_s": out_tokens / elapsed,
    }


def parse_case(text: str) -> tuple[str, list[int]]:
    kind, *numbers = text.split(":")
    arity = {"decode": 3, "prefill": 1, "nano": 1}
    if kind not in arity or len(numbers) != arity[kind]:
        raise SystemExit(f"bad case {text!r}: use decode:BATCH:IN:OUT, prefill:IN or nano:REQUESTS")
    return kind, [int(n) for n in numbers]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--cases", nargs="+", required=True)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    add_engine_arguments(parser)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    cases = [parse_case(c) for c in args.cases]

    from framework import LLM

    longest = max(
        [n[1] + n[2] for k, n in cases if k == "decode"]
        + [n[0] + 1 for k, n in cases if k == "prefill"]
        + [2048 for k, _ in cases if k == "nano"]
    )
    if args.model:  # a checkpoint folder (random_quantized_checkpoint.py, ...) instead of the shape's random weights
        if args.load_format == args.engine_option_defaults["load_format"]:
            args.load_format = "auto"  # its own weights, not the benchmarks' default random ones
        config = json.loads((Path(args.model) / "config.json").read_text())
        model = {}
    else:
        config = model_config(args.shape)
        # a long-context case needs the shape's context raised (Llama 3.1 has the 3-8B shape with 128k)
        config["max_position_embeddings"] = max(config["max_position_embeddings"], longest + 16)
        model = {"model": str(write_model_folder(config))}
    tp = tensor_parallel_size(args)
    started = time.perf_counter()
    llm = LLM(**engine_kwargs(args, **model, max_num_seqs=args.max_num_seqs, max_model_len=longest + 16))
    build_s = time.perf_counter() - started
    model = llm.engine.core.runner.model
    weight_bytes = bytes_read_per_token(model, config)  # MoE: only the experts one token uses; tied: the LM head
    shared = {
        **report_header(),
        "model": f"{args.model or args.shape + ' shape'} ({config['architectures'][0]}), random weights",
        "dtype": args.dtype,
        "tp": tp,
        "num_gpus": tp,
        "attention_backend": llm.engine.attention_backend,
        "cuda_graphs": llm.engine.summary.get("cuda_graphs"),
        "async_scheduling": llm.engine.summary.get("async_scheduling"),
    }
    results = []
    for kind, numbers in cases:
        if kind == "decode":
            result = run_decode(llm, *numbers)
            if numbers[0] == 1:
                roofline = COPY_BANDWIDTH / weight_bytes
                result |= {
                    "roofline_tokens_per_s": roofline,
                    "roofline_fraction": result["decode_tokens_per_s"] / roofline,
                }
        elif kind == "prefill":
            result = run_prefill(llm, *numbers)
        else:
            result = run_nano(llm, *numbers)
        results.append(shared | result)
        shown = result.get("decode_tokens_per_s") or result.get("prefill_tokens_per_s")
        if not shown:  # the engine gives up a failed step's requests: nothing was timed
            raise SystemExit(f"{kind}:{':'.join(map(str, numbers))} produced no tokens; the engine's error is above")
        print(
            f"{args.model or args.shape} {shared['attention_backend']} {kind}:{':'.join(map(str, numbers))} -> {shown:,.1f} tok/s"
            + (f" ({result['roofline_fraction']:.0%} of roofline)" if result.get("roofline_fraction") else ""),
            flush=True,
        )
    report = {
        "shape": None if args.model else args.shape,
        "weight_bytes": weight_bytes,
        "build_s": build_s,
        "summary": llm.engine.summary,
        "results": results,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=2, default=str))
    llm.close()


if __name__ == "__main__":
    run_engine_script(main)
