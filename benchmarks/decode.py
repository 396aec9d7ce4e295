"""Decode speed of fw's engine on random weights of a real model shape (run on the GPU machine).

    python benchmarks/decode.py --shape llama3-8b --batch 1 64 --context 128 4096 --out $OUT/decode.json
    python benchmarks/decode.py --shape llama3-8b --tp 2 --out $OUT/decode-tp2.json   # GPUs 0,1 (or --d 0,1)
    python benchmarks/decode.py --shape llama3-8b --tp 2 --all-reduce symm_mem --out $OUT/decode-tp2-symm.json
    python benchmarks/decode.py --shape qwen3-32b --tp 2 --batch 1 --context 128 --out $OUT/decode-32b-tp2.json
    python benchmarks/decode.py --shape qwen3-30b-a3b --batch 1 --context 128 --out $OUT/decode-moe.json
    python benchmarks/decode.py --shape deepseek-v2-lite --batch 1 8 --context 128 --out $OUT/decode-mla.json
    python benchmarks/decode.py --shape glm-4.7-flash --batch 1 --context 128 --out $OUT/decode-glm-4.7-flash.json
    python benchmarks/decode.py --shape llama4-scout-20l --batch 1 64 --context 128 --max-model-len 4096 --out $OUT/decode-llama4.json
    python benchmarks/decode.py --shape qwen3.5-27b --batch 1 64 --context 128 --out $OUT/decode-qwen3.5-27b.json
    python benchmarks/decode.py --shape qwen3.5-35b-a3b --batch 1 64 --context 128 --out $OUT/decode-qwen3.5-moe.json
    FW_KERNELS=linear=torch python benchmarks/decode.py --shape llama3-8b --tp 2 --batch 1 --context 128  # cuBLAS matmuls

``FW_KERNELS`` (forced kernel implementations, passed on to the tensor-parallel workers) is recorded
in the JSON as ``fw_kernels``.

For each case it builds the engine once (random weights through the model's own weight loaders,
``load_format="dummy"``), fills ``batch`` requests with ``context`` prompt tokens, then times
whole engine steps (schedule, inputs, graph replay, sampling, host ids) as the intervals between
successive returns of ``step()`` in steady decode, with no synchronisation of its own (so async
scheduling's overlap of step n + 1's preparation with step n counts, as it does for a user): the
median interval gives tokens/s (batch / interval) and the fraction of the roofline (weight bytes / device copy bandwidth, GPU.md: 4.28 TB/s on the H200).
With ``--tp N`` each GPU reads its shard, so the roofline uses one rank's weight bytes.
For MoE shapes the batch-1 roofline counts the bytes one token reads: the dense weights and
``top_k / num_experts`` of the experts. Prints a table last and writes the full JSON. On a CPU
(``--shape tiny`` or ``tiny-moe``) it runs the same steps, for checking the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
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
    device_ids,
    engine_kwargs,
    model_config,
    prefill_until_decode,
    report_header,
    run_engine_script,
    tensor_parallel_size,
    write_model_folder,
)


def run_case(llm, batch: int, context: int, steps: int, weight_bytes: int) -> dict:
    from framework import SamplingParams

    core = llm.engine.core
    generator = torch.Generator().manual_seed(batch * 7919 + context)
    # requests that finish their prompt early decode while the others still prefill
    prefill_steps = -(-batch * context // core.config.scheduler.max_num_batched_tokens) + 1
    params = SamplingParams(max_tokens=steps + prefill_steps + 8, ignore_eos=True, temperature=0.0)
    add_random_requests(llm, f"b{batch}-c{context}", batch, context, params, generator)
    prefill_until_decode(core)
    for _ in range(3):
        core.step()
    times = []
    wall = time.perf_counter()
    for _ in range(steps):
        outputs = core.step()  # returns host token ids: a step has finished on the device
        now = time.perf_counter()
        times.append(now - wall)
        wall = now
        assert len(outputs) == batch
    for request_id in list(core.requests):
        core.abort(request_id)
    step = statistics.median(times)
    return {
        "batch": batch,
        "context": context,
        "steps": steps,
        "median_step_ms": step * 1e3,
        "tokens_per_s": batch / step,
        "batch_size": batch,
        "input_len": context,
        "output_len": steps,
        "decode_tokens_per_s": batch / step,
        "roofline_tokens_per_s": COPY_BANDWIDTH / weight_bytes,
        "roofline_fraction": (batch / step) / (COPY_BANDWIDTH / weight_bytes) if batch == 1 else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=int, nargs="+", default=[128, 4096])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument(
        "--max-model-len",
        type=int,
        help="the engine's max_model_len (default: just enough for the cases). fw serve uses the "
        "model's, and the Triton decode kernel's split count in the graphs follows it",
    )
    add_engine_arguments(parser)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.max_model_len is not None and args.max_model_len < max(args.context) + args.steps + 1:
        parser.error(
            f"--max-model-len {args.max_model_len} cannot hold a context of {max(args.context)} plus {args.steps} steps"
        )
    devices, tp = device_ids(args), tensor_parallel_size(args)

    from framework import LLM

    config = model_config(args.shape)
    folder = write_model_folder(config)
    started = time.perf_counter()
    llm = LLM(
        **engine_kwargs(
            args,
            model=str(folder),
            max_num_seqs=max(args.batch),
            max_model_len=args.max_model_len
            or max(args.context) + args.steps + 16 + max(args.batch) * max(args.context) // 8192,
        ),
    )
    build_s = time.perf_counter() - started
    model = llm.engine.core.runner.model
    weight_bytes = bytes_read_per_token(model, config)
    results = [run_case(llm, b, c, args.steps, weight_bytes) for b in args.batch for c in args.context]
    header = report_header()
    for result in results:  # the GPU issue's keys on every result (output_len: the timed decode steps)
        result.update(
            device=header["device"],
            model=f"{args.shape} shape, random weights",
            dtype=args.dtype,
            tp=tp,
            num_gpus=tp,
            commit=header["commit"],
            command=header["command"],
        )
    report = {
        **header,
        "shape": args.shape,
        "dtype": args.dtype,
        "tp": tp,
        "all_reduce": args.all_reduce,
        "devices": devices or [0],
        "weight_bytes": weight_bytes,
        "weight_bytes_note": "per rank" if tp > 1 else "whole model",
        "build_s": build_s,
        "summary": llm.engine.summary,
        "fw_kernels": os.environ.get("FW_KERNELS", ""),
        "results": results,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=2, default=str))
    llm.close()
    print(
        f"{args.shape} {args.dtype} TP={tp} ({args.all_reduce} all-reduce) on {report['device']}: attention {llm.engine.attention_backend}, "
        f"graphs {llm.engine.summary.get('cuda_graphs')}, async {llm.engine.summary.get('async_scheduling')}, weights {weight_bytes / 1e9:.2f} GB, build {build_s:.0f} s"
        + (f", FW_KERNELS={report['fw_kernels']}" if report["fw_kernels"] else "")
    )
    print(f"{'batch':>6} {'context':>8} {'step ms':>9} {'tok/s':>9} {'roofline':>9}")
    for r in results:
        frac = f"{r['roofline_fraction']:.0%}" if r["roofline_fraction"] else "-"
        print(f"{r['batch']:>6} {r['context']:>8} {r['median_step_ms']:>9.2f} {r['tokens_per_s']:>9.1f} {frac:>9}")


if __name__ == "__main__":
    run_engine_script(main)
