"""``fw bench``: offline throughput with random prompts (EOS ignored), a table and JSON."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Annotated

import typer

from cli import options as o


@o.with_engine_options(exclude=o.NOT_IN_BENCH)
def bench(
    engine: o.EngineOptions,
    num_prompts: Annotated[int, typer.Option("--num-prompts", help="Requests to run.")] = 32,
    input_len: Annotated[int, typer.Option("--input-len", help="Mean prompt length in tokens.")] = 128,
    output_len: Annotated[int, typer.Option("--output-len", help="Mean output length in tokens.")] = 128,
    range_ratio: Annotated[
        float, typer.Option("--range-ratio", help="Lengths vary uniformly by +- this fraction.")
    ] = 0.0,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    output_json: Annotated[Path | None, typer.Option("--output-json", help="Write the full results here.")] = None,
) -> None:
    """Run NUM_PROMPTS random requests through the engine and report tokens/s."""
    from framework import LLM, SamplingParams
    from framework.errors import FwError

    try:
        started = time.perf_counter()
        llm = LLM(**engine.args().to_dict())
        load_s = time.perf_counter() - started
    except (FwError, ValueError) as exc:
        raise o.fail(str(exc)) from None
    rng = random.Random(seed)
    vocab = llm.engine.model_config.vocab_size
    span = lambda mean: max(1, rng.randint(int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))))  # noqa: E731
    prompts, params = [], []
    for _ in range(num_prompts):
        prompts.append({"prompt_token_ids": [rng.randrange(vocab) for _ in range(span(input_len))]})
        params.append(SamplingParams(max_tokens=span(output_len), ignore_eos=True, temperature=0.0))
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    started = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - started
    num_in = sum(len(p["prompt_token_ids"]) for p in prompts)
    num_out = sum(len(r.outputs[0].token_ids) for r in results)
    report = {
        "summary": llm.engine.summary,
        "tp": llm.engine.summary.get("tensor_parallel_size", 1),
        "num_prompts": num_prompts,
        "input_tokens": num_in,
        "output_tokens": num_out,
        "elapsed_s": elapsed,
        "load_s": load_s,
        "requests_per_s": num_prompts / elapsed,
        "output_tokens_per_s": num_out / elapsed,
        "total_tokens_per_s": (num_in + num_out) / elapsed,
    }
    llm.close()
    if output_json:
        output_json.write_text(json.dumps(report, indent=2, default=str))
    typer.echo(
        f"model {report['summary']['model']} on {report['summary']['device']} ({report['summary']['dtype']}, "
        f"attention {report['summary']['attention_backend']})"
    )
    typer.echo(
        f"{'requests':>10} {'in tok':>8} {'out tok':>8} {'time s':>8} {'req/s':>8} {'out tok/s':>10} {'total tok/s':>12}"
    )
    typer.echo(
        f"{num_prompts:>10} {num_in:>8} {num_out:>8} {elapsed:>8.2f} {report['requests_per_s']:>8.2f} "
        f"{report['output_tokens_per_s']:>10.1f} {report['total_tokens_per_s']:>12.1f}"
    )
