"""Quality of every ``--isq`` type on a real model, on the CPU: KL divergence and greedy agreement
against the 16-bit source.

    python benchmarks/isq_quality.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out docs/benchmarks/isq-smollm2.json

The GGUF is dequantized to a bf16 Hugging Face directory (``fw_gguf.to_safetensors``): that is the
source. fw generates ``--steps`` greedy tokens from the source for each of the 32 prompts of
``quantize_quality.py``; then each ``--isq`` type loads the source quantized at load and runs on
prompt + those tokens (teacher forcing, float32 on the CPU) to report how often its argmax is the
source's token (``greedy_agreement``) and the mean KL(source || quantized) of the next-token
distributions there, with the weight memory and the time ``--isq`` took.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch
from common import report_header
from fw_gguf.to_safetensors import write_hf_checkpoint
from quantize_quality import PROMPTS, top1_and_kl

from framework import LLM, SamplingParams
from framework.tokenizer import Tokenizer

TYPES = ["q8_0", "q6k", "q5k", "q5_1", "q5_0", "q4k", "q4_1", "q4_0", "q3k", "q2k", "int8", "int4"]
CHUNK = 4  # prompts per engine call: bounds the recorded hidden states and logits


def next_token_logprobs(llm: LLM, sequences: list[list[int]], starts: list[int], consume) -> None:
    """``consume(i, logprobs)`` for each sequence ``i``: ``[len - start, vocab]`` float32 log-probs
    predicting tokens ``start..len-1``. The engine's hidden states are recorded per position and
    logits made for the wanted rows only, dropped once consumed (Gemma's vocabulary is 262k)."""
    runner, hidden_rows = llm.engine.core.runner, {}
    forward = runner.forward

    def recording_forward(batch, *inputs):
        hidden = forward(batch, *inputs)
        offset = 0
        for request, num_new in zip(batch.requests, batch.num_new_tokens, strict=True):
            for j in range(num_new):
                hidden_rows[(request.request_id, request.num_computed_tokens + j)] = hidden[offset + j].clone()
            offset += num_new
        return hidden

    runner.forward = recording_forward
    try:
        for begin in range(0, len(sequences), CHUNK):
            part, part_starts = sequences[begin : begin + CHUNK], starts[begin : begin + CHUNK]
            hidden_rows.clear()
            results = llm.generate([{"prompt_token_ids": s} for s in part], SamplingParams(temperature=0, max_tokens=1))
            for index, (result, sequence, start) in enumerate(zip(results, part, part_starts, strict=True)):
                positions = range(start - 1, len(sequence) - 1)
                rows = torch.stack([hidden_rows[(f"{result.request_id}-0", i)] for i in positions])
                consume(begin + index, runner.model.compute_logits(rows).float().log_softmax(-1))
    finally:
        runner.forward = forward


def write_report(path: str | None, args, num_prompts: int, rows: list[dict]) -> None:
    if path:
        header = {**report_header(), "source": f"{args.gguf.name} dequantized to bf16"}
        report = {**header, "num_prompts": num_prompts, "steps": args.steps, "results": rows}
        Path(path).write_text(json.dumps(report, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", required=True, type=Path)
    parser.add_argument("--types", nargs="+", default=TYPES)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--out")
    args = parser.parse_args()
    source = write_hf_checkpoint(args.gguf, Path(tempfile.mkdtemp()) / "source-bf16")
    tokenizer = Tokenizer.from_directory(source)
    prompts = [tokenizer.backend.encode(p).ids for p in PROMPTS]
    engine = dict(device="cpu", dtype="float32", num_blocks=256, enable_prefix_caching=False)
    reference: dict[int, torch.Tensor] = {}
    with LLM(str(source), **engine) as llm:
        results = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True),
        )
        continuations = [r.outputs[0].token_ids for r in results]
        sequences = [p + c for p, c in zip(prompts, continuations, strict=True)]
        starts = [len(p) for p in prompts]
        next_token_logprobs(llm, sequences, starts, lambda i, lp: reference.__setitem__(i, lp.to(torch.bfloat16)))
        source_bytes = llm.engine.summary["weight_bytes"]
    del llm
    gc.collect()
    rows = []
    print(f"{'type':6s} {'agree %':>8s} {'mean KL':>9s} {'weights MiB':>11s} {'isq s':>7s}", flush=True)
    for isq in args.types:
        scores: dict[int, tuple[float, float]] = {}

        def score(i, logprobs, scores=scores):
            scores[i] = top1_and_kl([reference[i]], [logprobs], [continuations[i]])

        started = time.perf_counter()
        with LLM(str(source), isq=isq, **engine) as llm:
            load_s = time.perf_counter() - started
            summary = llm.engine.summary
            next_token_logprobs(llm, sequences, starts, score)
        del llm
        gc.collect()
        # every sequence has args.steps positions: the mean of the per-sequence means is the mean
        row = {
            "isq": isq,
            "greedy_agreement": sum(a for a, _ in scores.values()) / len(scores),
            "mean_kl": sum(k for _, k in scores.values()) / len(scores),
            "weight_bytes": summary["weight_bytes"],
            "source_weight_bytes": source_bytes,
            "isq_summary": summary.get("isq"),
            "load_s": load_s,
        }
        rows.append(row)
        print(
            f"{isq:6s} {100 * row['greedy_agreement']:8.1f} {row['mean_kl']:9.4f} "
            f"{row['weight_bytes'] / 2**20:11.1f} {load_s:7.1f}",
            flush=True,
        )
        write_report(args.out, args, len(prompts), rows)  # after every type: a run cut short keeps its rows


if __name__ == "__main__":
    main()
