"""The GPU issue's benchmark setups on random weights of real model shapes (run on the GPU machine).

    python benchmarks/gpu_suite.py --shape llama3-8b --attention-backend triton \
        --cases decode:1:4096:1024 decode:1:512:256 decode:64:128:128 prefill:512 --out $OUT/suite.json
    python benchmarks/gpu_suite.py --shape qwen2.5-0.5b --cases nano:256 --out $OUT/nano.json

Cases (one engine is built per run, random weights through the model's own loaders):

- ``decode:B:IN:OUT`` — ``B`` requests of ``IN`` random prompt tokens generate ``OUT`` tokens each
  (EOS ignored); after every prompt is processed, the remaining decode steps are timed until the
  last request finishes: ``decode_tokens_per_s`` = tokens generated in that window / its time.
  At batch 1 the fraction of the roofline (weight bytes / copy bandwidth) is reported too.
- ``prefill:IN`` — one prompt of ``IN`` tokens (prefix cache off), median of 5 runs of the whole
  prefill step (forward + first token): ``prefill_tokens_per_s``.
- ``nano:N`` — nano-vllm's offline benchmark: ``N`` requests, input and output lengths uniform in
  100..1024 (seed 0), EOS ignored, all submitted at once: output tokens / wall time.

Every result carries ``device``, ``model``, ``dtype``, ``batch_size``, ``input_len``,
``output_len``, ``decode_tokens_per_s``, ``commit`` and ``command``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from decode import COPY_BANDWIDTH, SHAPES, bytes_read_per_token, git_commit

#: Architectures of the shapes; ``decode.SHAPES`` are Llama-architecture shapes.
EXTRA_SHAPES = {
    "qwen2.5-0.5b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896,
                         intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True,
                         rope_theta=1000000.0, rms_norm_eps=1e-6),
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=True,
                       rope_theta=1000000.0, rms_norm_eps=1e-6),
}


def model_config(shape: str) -> dict:
    if shape in EXTRA_SHAPES:
        return dict(EXTRA_SHAPES[shape])
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5, **SHAPES[shape]}


def random_prompt(vocab: int, length: int, generator: torch.Generator) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=generator).tolist()


def run_decode(llm, batch: int, input_len: int, output_len: int) -> dict:
    from framework import SamplingParams
    from framework.engine.request import PLACEHOLDER

    core, vocab = llm.engine.core, llm.engine.model_config.vocab_size
    generator = torch.Generator().manual_seed(batch * 7919 + input_len)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    ids = [f"d{batch}-{input_len}-{i}" for i in range(batch)]
    for request_id in ids:
        core.add_request(request_id, random_prompt(vocab, input_len, generator), params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.requests.values()):
        core.step()  # prefill (chunked); early requests already decode
    # tokens already produced (a placeholder is a token of the step still in flight: not yet done)
    done_before = sum(r.num_output_tokens - r.output_token_ids.count(PLACEHOLDER) for r in core.requests.values())
    finished_before = batch - len(core.requests)
    torch.cuda.synchronize()
    started = time.perf_counter()
    steps = 0
    while core.requests:
        core.step()
        steps += 1
    elapsed = time.perf_counter() - started
    tokens = (batch - finished_before) * output_len - done_before
    return {"case": "decode", "batch_size": batch, "input_len": input_len, "output_len": output_len,
            "decode_steps": steps, "decode_s": elapsed, "decode_tokens_per_s": tokens / elapsed}


def run_prefill(llm, input_len: int, repeats: int = 5) -> dict:
    from framework import SamplingParams

    core, vocab = llm.engine.core, llm.engine.model_config.vocab_size
    generator = torch.Generator().manual_seed(input_len)
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    times = []
    for i in range(repeats + 1):
        core.add_request(f"p{input_len}-{i}", random_prompt(vocab, input_len, generator), params)
        torch.cuda.synchronize()
        started = time.perf_counter()
        while core.requests:
            core.step()
        if i:  # the first run warms up this prompt length
            times.append(time.perf_counter() - started)
    step = statistics.median(times)
    return {"case": "prefill", "batch_size": 1, "input_len": input_len, "output_len": 1, "prefill_s": step,
            "prefill_tokens_per_s": input_len / step, "decode_tokens_per_s": None}


def run_nano(llm, num_requests: int) -> dict:
    """nano-vllm's bench.py: lengths uniform in 100..1024, seed 0, all requests at once."""
    from framework import SamplingParams

    rng = random.Random(0)
    vocab = llm.engine.model_config.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randint(100, 1024))]}
               for _ in range(num_requests)]
    params = [SamplingParams(temperature=0.6, max_tokens=rng.randint(100, 1024), ignore_eos=True)
              for _ in range(num_requests)]
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - started
    out_tokens = sum(len(r.outputs[0].token_ids) for r in outputs)
    return {"case": "nano-vllm", "batch_size": num_requests, "input_len": "uniform 100..1024",
            "output_len": "uniform 100..1024", "input_tokens": sum(len(p["prompt_token_ids"]) for p in prompts),
            "output_tokens": out_tokens, "elapsed_s": elapsed, "decode_tokens_per_s": out_tokens / elapsed,
            "output_tokens_per_s": out_tokens / elapsed}


def parse_case(text: str) -> tuple[str, list[int]]:
    kind, *numbers = text.split(":")
    arity = {"decode": 3, "prefill": 1, "nano": 1}
    if kind not in arity or len(numbers) != arity[kind]:
        raise SystemExit(f"bad case {text!r}: use decode:BATCH:IN:OUT, prefill:IN or nano:REQUESTS")
    return kind, [int(n) for n in numbers]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3-8b", choices=sorted({*SHAPES, *EXTRA_SHAPES}))
    parser.add_argument("--cases", nargs="+", required=True)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--disable-cuda-graph", action="store_true")
    parser.add_argument("--no-async-scheduling", action="store_true", help="read each step back before the next")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    cases = [parse_case(c) for c in args.cases]

    from framework import LLM

    config = model_config(args.shape)
    longest = max([n[1] + n[2] for k, n in cases if k == "decode"] + [n[0] + 1 for k, n in cases if k == "prefill"]
                  + [2048 for k, _ in cases if k == "nano"])
    # a long-context case needs the shape's context raised (Llama 3.1 has the 3-8B shape with 128k)
    config["max_position_embeddings"] = max(config["max_position_embeddings"], longest + 16)
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(config))
    started = time.perf_counter()
    llm = LLM(str(folder), load_format="dummy", dtype=args.dtype, attention_backend=args.attention_backend,
              max_num_seqs=args.max_num_seqs, max_model_len=longest + 16,
              enable_cuda_graphs=not args.disable_cuda_graph, enable_prefix_caching=False,
              async_scheduling=False if args.no_async_scheduling else None)
    build_s = time.perf_counter() - started
    model = llm.engine.core.runner.model
    weight_bytes = bytes_read_per_token(model)  # MoE: only the experts one token uses
    if config.get("tie_word_embeddings"):  # the LM head reads the embedding table
        embed = model.model.embed_tokens.weight
        weight_bytes += embed.numel() * embed.element_size()
    argv = sys.argv[1:]
    if "--out" in argv:  # the output path is the machine's, not part of the setup
        del argv[argv.index("--out"):argv.index("--out") + 2]
    command = "python benchmarks/gpu_suite.py " + " ".join(argv)
    common = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0),
              "model": f"{args.shape} shape ({config['architectures'][0]}), random weights", "dtype": args.dtype,
              "attention_backend": llm.engine.attention_backend, "cuda_graphs": llm.engine.summary.get("cuda_graphs"),
              "async_scheduling": llm.engine.summary.get("async_scheduling"),
              "commit": git_commit(), "command": command, "torch": torch.__version__}
    results = []
    for kind, numbers in cases:
        if kind == "decode":
            result = run_decode(llm, *numbers)
            if numbers[0] == 1:
                roofline = COPY_BANDWIDTH / weight_bytes
                result |= {"roofline_tokens_per_s": roofline, "roofline_fraction": result["decode_tokens_per_s"] / roofline}
        elif kind == "prefill":
            result = run_prefill(llm, *numbers)
        else:
            result = run_nano(llm, *numbers)
        results.append(common | result)
        shown = result.get("decode_tokens_per_s") or result.get("prefill_tokens_per_s")
        print(f"{args.shape} {common['attention_backend']} {kind}:{':'.join(map(str, numbers))} -> {shown:,.1f} tok/s"
              + (f" ({result['roofline_fraction']:.0%} of roofline)" if result.get("roofline_fraction") else ""),
              flush=True)
    report = {"shape": args.shape, "weight_bytes": weight_bytes, "build_s": build_s, "summary": llm.engine.summary,
              "results": results}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
