"""Quality of ``fw quantize`` on a real model, on the CPU: greedy agreement and KL divergence against the source.

    python benchmarks/quantize_quality.py --src SmolLM2-135M-Instruct.Q4_1.gguf --out docs/benchmarks/quantize_quality.json
    python benchmarks/quantize_quality.py --src ./my-bf16-model --methods gptq --bits 4 --group-size 128

A ``.gguf`` source is first dequantized to bf16 by transformers (as the issue's "SmolLM2 or Gemma 3
270M dequantized to bf16"). Each method writes its checkpoint with the CLI's code path; then, for
32 prompts, fw generates 32 greedy tokens from the source, and fw runs each quantized checkpoint
on prompt + those tokens (teacher forcing, float32 on the CPU) to report: how often its argmax is
the source's token (``teacher_forced_top1``), the mean KL(source || quantized) of the next-token
distributions there, and how many of its own 32 free-running greedy tokens equal the source's
(``free_running_agreement``, positionwise).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from common import report_header
from fw_gptq.quantize.cli import default_calibration_text
from fw_gptq.quantize.run import QuantizeJob, run_quantize

from framework import LLM, SamplingParams
from framework.testing import capture_logits

PROMPTS = [
    "The history of the printing press",
    "How do vaccines train the immune system?",
    "Write a short poem about autumn.",
    "Explain what a hash table is.",
    "The best way to learn a new language is",
    "In 1969, astronauts landed on",
    "A recipe for pancakes needs",
    "Photosynthesis is the process by which",
    "Give three tips for better sleep.",
    "The main causes of the French Revolution were",
    "def quicksort(arr):",
    "What is the difference between a virus and",
    "The city of Tokyo is known for",
    "Describe the water cycle.",
    "Once upon a time, a dragon",
    "Why do cats purr?",
    "The theory of relativity says that",
    "List the planets of the solar system.",
    "A good password should",
    "The stock market is",
    "How does a bicycle stay upright?",
    "The Amazon rainforest",
    "Translate 'good morning' into",
    "An email to my manager asking for",
    "The capital of Australia is",
    "Machine learning models learn by",
    "The ocean is salty because",
    "My favourite book is",
    "To change a flat tyre, first",
    "Electric cars are",
    "The human heart has four",
    "Summarize the plot of Romeo and Juliet.",
]
STEPS = 32


def bf16_source(src: Path, work: Path) -> Path:
    if src.suffix != ".gguf":
        return src
    import transformers

    out = work / "source-bf16"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.bfloat16)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the values are dequantized: a plain bf16 model from here
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name).save_pretrained(out)
    return out


def prompt_ids(path: Path) -> list[list[int]]:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return [tokenizer(p).input_ids for p in PROMPTS]


def greedy(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    with LLM(str(path), device="cpu", dtype="float32", num_blocks=256) as llm:
        results = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
        )
    return [r.outputs[0].token_ids for r in results]


def continuation_logits(path: Path, prompts: list[list[int]], continuations: list[list[int]]) -> list[torch.Tensor]:
    """``[STEPS, vocab]`` logits predicting each continuation token, per prompt."""
    with LLM(str(path), device="cpu", dtype="float32", num_blocks=256) as llm:
        records = capture_logits(llm)
        requests = [{"prompt_token_ids": p + c} for p, c in zip(prompts, continuations, strict=True)]
        llm.generate(requests, SamplingParams(temperature=0, max_tokens=1))
        return [torch.stack([records[(f"{i}-0", len(p) - 1 + j)] for j in range(STEPS)]) for i, p in enumerate(prompts)]


def top1_and_kl(
    reference: list[torch.Tensor], logits: list[torch.Tensor], tokens: list[list[int]]
) -> tuple[float, float]:
    """Over every position of every prompt: how often ``logits``' argmax is the reference's token,
    and the mean KL(reference || logits) of the next-token distributions (logits or log-probs)."""
    kl, top1 = [], []
    for ref, got, ids in zip(reference, logits, tokens, strict=True):
        p_log, q_log = ref.float().log_softmax(-1), got.float().log_softmax(-1)
        kl.append((p_log.exp() * (p_log - q_log)).sum(-1))
        top1.append((got.argmax(-1) == torch.tensor(ids)).float())
    return float(torch.cat(top1).mean()), float(torch.cat(kl).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", required=True, type=Path)
    parser.add_argument("--methods", nargs="+", default=["gptq", "awq", "rtn"])
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--num-samples", type=int, default=32)
    parser.add_argument("--out")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp())
    source = bf16_source(args.src, work)
    prompts = prompt_ids(source)
    reference = greedy(source, prompts)
    reference_logits = continuation_logits(source, prompts, reference)
    results = []
    print(
        f"{'method':6s} {'bits':>4s} {'group':>5s} {'top1 %':>7s} {'mean KL':>9s} {'greedy %':>8s} {'quantize s':>10s}"
    )
    for method in args.methods:
        started = time.perf_counter()
        run_quantize(
            QuantizeJob(
                source,
                work / method,
                method,
                args.bits,
                args.group_size,
                None,
                False,
                default_calibration_text(),
                args.num_samples,
                256,
            ),
            echo=lambda _: None,
        )
        seconds = time.perf_counter() - started
        logits = continuation_logits(work / method, prompts, reference)
        top1, kl = top1_and_kl(reference_logits, logits, reference)
        own = greedy(work / method, prompts)
        agree = sum(a == b for o, r in zip(own, reference) for a, b in zip(o, r)) / (len(prompts) * STEPS)
        result = {
            "method": method,
            "bits": args.bits,
            "group_size": args.group_size,
            "num_prompts": len(prompts),
            "steps": STEPS,
            "teacher_forced_top1": top1,
            "mean_kl": kl,
            "free_running_agreement": agree,
            "quantize_s": seconds,
        }
        results.append(result)
        print(
            f"{method:6s} {args.bits:4d} {args.group_size:5d} {100 * result['teacher_forced_top1']:7.1f} "
            f"{result['mean_kl']:9.4f} {100 * agree:8.1f} {seconds:10.1f}",
            flush=True,
        )
    if args.out:
        Path(args.out).write_text(
            json.dumps({**report_header(), "source": str(args.src), "results": results}, indent=2)
        )


if __name__ == "__main__":
    main()
