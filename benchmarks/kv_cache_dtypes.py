"""Speed and capacity of each KV-cache dtype on one memory budget (run on the GPU machine).

    python benchmarks/kv_cache_dtypes.py --shape llama3-8b --dtypes auto fp8 turbo4 turbo8 --cases batch1 short \\
        --steps 16 --out $OUT/kv-dtypes-b1.json                                    # batch 1 at 32k and 128
    python benchmarks/kv_cache_dtypes.py --shape llama3-8b --dtypes auto turbo4 --cases many --layers 4 \\
        --many-steps 16 --out $OUT/kv-dtypes-many.json          # 64 x 32k requests, steady decode, 4 of 32 layers
    python benchmarks/kv_cache_dtypes.py --shape tiny --dtype f32 --context 64 --short-context 16 --requests 4 --mem 4 \\
        --output-len 4 --steps 3 --out /tmp/kv.json                                              # CPU: the script itself

For each dtype it builds one engine on random weights (``load_format="dummy"``) with the same KV
budget (``--mem`` MB) and measures (``--cases``, all by default; each result printed as it comes):

* ``batch1``: steady decode of one request with ``--context`` prompt tokens (median step, as
  ``decode.py`` times it), and ``short`` the same at ``--short-context`` (the cost of quantizing
  on short contexts);
* ``many``: ``--requests`` requests of ``--context`` prompt tokens, all submitted at once; as many
  run together as the cache holds (the rest wait or are preempted), so a smaller cache row means
  more requests per step. Without ``--many-steps``: each makes ``--output-len`` new tokens, output
  tokens per second of wall time (prefill included). With ``--many-steps N``: once the requests
  that fit have their prompts computed, output tokens per second over N steps of steady decode
  (prefilling all 64 x 32k prompts would take minutes). Also the most requests that ran in a step.

``--layers N`` keeps N of the shape's layers and scales ``--mem`` by the same fraction, so the
same number of requests fit as in the whole model at ``--mem``: the throughput case's prefill
then takes N / layers of the time (the per-layer decode work, and so the dtypes' ratios, stay;
the embedding and head weigh a little more). Each engine build captures CUDA graphs for up to
``--requests`` sequences with ``many`` among the cases, else for one (the least a build takes).
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

CASES = ("batch1", "short", "many")


def many_requests(llm, requests: int, context: int, output_len: int, steady_steps: int | None) -> dict:
    """Throughput of ``requests`` requests of ``context`` random prompt tokens: to completion of
    ``output_len`` new tokens each, or (``steady_steps``) over that many steps once decoding."""
    from framework import SamplingParams

    core = llm.engine.core
    max_tokens = output_len if steady_steps is None else steady_steps + 64
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    add_random_requests(llm, "many", requests, context, params, torch.Generator().manual_seed(requests))
    started, generated, most_running, steps = time.perf_counter(), 0, 0, 0
    if steady_steps is not None:
        # prefill what fits: until a step gives every running request a token (none is still prefilling)
        while core.has_unfinished():
            outputs = core.step()
            running = len(core.scheduler.running)
            decoding = all(r.num_computed_tokens >= r.num_prompt_tokens for r in core.scheduler.running)
            if running and decoding and len(outputs) >= running:
                break
        prefill_s, preempted = time.perf_counter() - started, core.stats().num_preemptions
        started = time.perf_counter()
    while core.has_unfinished() and (steady_steps is None or steps < steady_steps):
        generated += sum(len(output.new_token_ids) for output in core.step())
        most_running = max(most_running, len(core.scheduler.running))
        steps += 1
    wall = time.perf_counter() - started
    result = {
        "requests": requests,
        "context": context,
        "output_len": output_len if steady_steps is None else None,
        "steady_steps": steady_steps,
        "wall_s": wall,
        "output_tokens": generated,
        "output_tokens_per_s": generated / wall,
        "most_running": most_running,
        "preemptions": core.stats().num_preemptions,
    }
    if steady_steps is not None:
        result.update(prefill_s=prefill_s, preemptions=result["preemptions"] - preempted)
        for request_id in list(core.requests):
            core.abort(request_id)
    return result


def run_dtype(args: argparse.Namespace, folder: Path, config: dict, kv_dtype: str) -> dict:
    from framework import LLM

    started = time.perf_counter()
    llm = LLM(
        str(folder),
        **engine_kwargs(
            args,
            kv_cache_dtype=kv_dtype,
            mem_mb=args.mem,
            max_num_seqs=args.requests if "many" in args.cases else 1,  # fewer graphs to capture
            max_model_len=args.context + max(args.output_len, args.steps, (args.many_steps or 0) + 64) + 64,
        ),
    )
    summary = llm.engine.summary
    weight_bytes = bytes_read_per_token(llm.engine.core.runner.model, config)
    result = {
        "kv_cache_dtype": kv_dtype,
        "attention_backend": llm.engine.attention_backend,
        "kv_tokens": summary["kv_tokens"],
        "kv_bytes_per_token": summary["kv_bytes_per_token"],
        "build_s": time.perf_counter() - started,
    }
    say(
        f"{kv_dtype}: {result['kv_tokens']} tokens of cache, {result['kv_bytes_per_token']} B/token, built in {result['build_s']:.0f} s"
    )
    cases = {
        "batch1": lambda: run_case(llm, 1, args.context, args.steps, weight_bytes),
        "short": lambda: run_case(llm, 1, args.short_context, args.steps, weight_bytes),
        "many": lambda: many_requests(llm, args.requests, args.context, args.output_len, args.many_steps),
    }
    for case in args.cases:
        started = time.perf_counter()
        result["batch1_short" if case == "short" else case] = measured = cases[case]()
        rate = measured.get("tokens_per_s", measured.get("output_tokens_per_s"))
        say(f"{kv_dtype} {case}: {rate:.1f} tok/s ({time.perf_counter() - started:.0f} s)")
    llm.close()
    return result


def say(line: str) -> None:
    print(line, flush=True)


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
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES, help="what to measure per dtype")
    parser.add_argument("--many-steps", type=int, help="many: time this many steps of steady decode, not to completion")
    parser.add_argument("--layers", type=int, help="keep this many of the shape's layers (--mem scaled to match)")
    add_engine_arguments(parser)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    config = model_config(args.shape)
    if args.layers:
        full_layers = config["num_hidden_layers"]
        if not 0 < args.layers <= full_layers:
            parser.error(f"--layers must be 1..{full_layers} for {args.shape}, got {args.layers}")
        args.mem = max(1, args.mem * args.layers // full_layers)
        config["num_hidden_layers"] = args.layers
        say(f"{args.layers} of {full_layers} layers, KV budget scaled to {args.mem} MB")
    # a long-context case needs the shape's context raised (Llama 3.1 has the 3-8B shape with 128k), as gpu_suite.py does
    config["max_position_embeddings"] = max(
        config["max_position_embeddings"], args.context + max(args.output_len, args.steps) + 1024
    )
    folder = write_model_folder(config)
    results = [run_dtype(args, folder, config, kv_dtype) for kv_dtype in args.dtypes]
    report = {**report_header(), "shape": args.shape, "dtype": args.dtype, "mem_mb": args.mem, "results": results}
    report["layers"] = config["num_hidden_layers"]
    if args.out:
        args.out.write_text(json.dumps(report, indent=2, default=str))
    print(f"{args.shape} {args.dtype} on {report['device']}, KV budget {args.mem} MB, {report['layers']} layers")
    print(
        f"{'kv dtype':>9} {'tokens':>9} {'B/token':>8} {'b1 tok/s':>9} {'short':>8} {'many tok/s':>11} {'running':>8}"
    )
    for r in results:
        cells = [
            f"{r['batch1']['tokens_per_s']:>9.1f}" if "batch1" in r else f"{'-':>9}",
            f"{r['batch1_short']['tokens_per_s']:>8.1f}" if "batch1_short" in r else f"{'-':>8}",
            f"{r['many']['output_tokens_per_s']:>11.1f}" if "many" in r else f"{'-':>11}",
            f"{r['many']['most_running']:>8}" if "many" in r else f"{'-':>8}",
        ]
        print(f"{r['kv_cache_dtype']:>9} {r['kv_tokens']:>9} {r['kv_bytes_per_token']:>8} " + " ".join(cells))


if __name__ == "__main__":
    main()
