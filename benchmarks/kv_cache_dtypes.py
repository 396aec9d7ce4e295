"""Speed and capacity of each KV-cache dtype on one memory budget (run on the GPU machine).

    python benchmarks/kv_cache_dtypes.py --shape llama3-8b --dtypes auto fp8 --out $OUT/kv-dtypes-a.json
    python benchmarks/kv_cache_dtypes.py --shape llama3-8b --dtypes turbo8 turbo4 turbo3 --out $OUT/kv-dtypes-b.json
    python benchmarks/kv_cache_dtypes.py --shape tiny --dtype f32 --context 64 --short-context 16 --requests 4 --mem 4 \\
        --output-len 4 --steps 3 --out /tmp/kv.json                                              # CPU: the script itself

For each dtype it builds one engine on random weights (``load_format="dummy"``) with the same KV
budget (``--mem`` MB) and measures:

* ``batch1``: steady decode of one request with ``--context`` prompt tokens (median step, as
  ``decode.py`` times it), and the same at ``--short-context`` (the cost of quantizing on short
  contexts);
* ``many``: ``--requests`` requests of ``--context`` prompt tokens and ``--output-len`` new tokens
  each, all submitted at once; as many run together as the cache holds (the rest wait or are
  preempted), so a smaller cache row means more requests per step. Output tokens per second of
  wall time (prefill included) and the most requests that ran in one step.

Each engine build captures CUDA graphs (about a minute for an 8B shape): give a few dtypes per
call to stay inside a 10-minute run. Prints a table and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from common import (
    SHAPES,
    add_engine_arguments,
    add_random_requests,
    bytes_read_per_token,
    engine_kwargs,
    model_config,
    report_header,
    write_model_folder,
)
from decode import run_case


def many_requests(llm, requests: int, context: int, output_len: int) -> dict:
    """Throughput of ``requests`` requests of ``context`` random prompt tokens and ``output_len`` new tokens."""
    from framework import SamplingParams

    core = llm.engine.core
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    add_random_requests(llm, "many", requests, context, params, torch.Generator().manual_seed(requests))
    started, generated, most_running = time.perf_counter(), 0, 0
    while core.has_unfinished():
        generated += sum(len(output.new_token_ids) for output in core.step())
        most_running = max(most_running, len(core.scheduler.running))
    wall = time.perf_counter() - started
    return {
        "requests": requests,
        "context": context,
        "output_len": output_len,
        "wall_s": wall,
        "output_tokens": generated,
        "output_tokens_per_s": generated / wall,
        "most_running": most_running,
        "preemptions": core.stats().num_preemptions,
    }


def run_dtype(args: argparse.Namespace, folder: Path, config: dict, kv_dtype: str) -> dict:
    from framework import LLM

    llm = LLM(
        str(folder),
        **engine_kwargs(
            args,
            kv_cache_dtype=kv_dtype,
            mem_mb=args.mem,
            max_num_seqs=args.requests,
            max_model_len=args.context + max(args.output_len, args.steps) + 64,
        ),
    )
    summary = llm.engine.summary
    weight_bytes = bytes_read_per_token(llm.engine.core.runner.model, config)
    result = {
        "kv_cache_dtype": kv_dtype,
        "attention_backend": llm.engine.attention_backend,
        "kv_tokens": summary["kv_tokens"],
        "kv_bytes_per_token": summary["kv_bytes_per_token"],
        "batch1": run_case(llm, 1, args.context, args.steps, weight_bytes),
        "batch1_short": run_case(llm, 1, args.short_context, args.steps, weight_bytes),
        "many": many_requests(llm, args.requests, args.context, args.output_len),
    }
    llm.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=["auto", "fp8", "turbo8", "turbo4", "turbo3"])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--short-context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps of the batch-1 cases")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--mem", type=int, default=40960, help="KV-cache budget in MB, the same for every dtype")
    add_engine_arguments(parser)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    config = model_config(args.shape)
    # a long-context case needs the shape's context raised (Llama 3.1 has the 3-8B shape with 128k), as gpu_suite.py does
    config["max_position_embeddings"] = max(
        config["max_position_embeddings"], args.context + max(args.output_len, args.steps) + 1024
    )
    folder = write_model_folder(config)
    results = [run_dtype(args, folder, config, kv_dtype) for kv_dtype in args.dtypes]
    report = {**report_header(), "shape": args.shape, "dtype": args.dtype, "mem_mb": args.mem, "results": results}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2, default=str))
    print(f"{args.shape} {args.dtype} on {report['device']}, KV budget {args.mem} MB")
    print(
        f"{'kv dtype':>9} {'tokens':>9} {'B/token':>8} {'b1 tok/s':>9} {'short':>8} {'many tok/s':>11} {'running':>8}"
    )
    for r in results:
        print(
            f"{r['kv_cache_dtype']:>9} {r['kv_tokens']:>9} {r['kv_bytes_per_token']:>8} "
            f"{r['batch1']['tokens_per_s']:>9.1f} {r['batch1_short']['tokens_per_s']:>8.1f} "
            f"{r['many']['output_tokens_per_s']:>11.1f} {r['many']['most_running']:>8}"
        )


if __name__ == "__main__":
    main()
