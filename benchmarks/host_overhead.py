"""The engine's host time per step, with the model and the sampler stubbed out (runs on a CPU).

    python benchmarks/host_overhead.py --requests 256 --output-len 200

Everything a step does on the host runs for real (``LLM.generate``, scheduling, input
preparation, reading results back, stop checks, outputs); the forward pass returns zeros and the
sampler returns token 7 for every row, so what is timed is what a GPU would wait for when the
host is slower than the device (nano-vllm's benchmark has 256 requests in flight). Prints the
median decode step and the ``generate`` time per step outside ``step()``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import nano_requests, write_model_folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=200)
    parser.add_argument("--async-scheduling", action="store_true")
    args = parser.parse_args()

    from framework import LLM, SamplingParams
    from framework.engine.sampler import SamplerOutput

    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 32,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "vocab_size": 1024,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
    }
    folder = write_model_folder(config)
    kwargs = {"async_scheduling": True} if args.async_scheduling else {}
    llm = LLM(
        str(folder),
        load_format="dummy",
        dtype="f32",
        max_model_len=2100,
        enable_prefix_caching=False,
        num_blocks=args.requests * 140,
        max_num_seqs=args.requests,
        **kwargs,
    )
    core, runner = llm.engine.core, llm.engine.core.runner
    runner.run_model = lambda ids, positions, metadata: torch.zeros(metadata.num_tokens, 32)
    runner.model.compute_logits = lambda hidden: torch.zeros(hidden.shape[0], 1024)
    runner.sampler = lambda logits, rows, pending=None: SamplerOutput(torch.full((len(rows),), 7), None, None, None)
    prompts, _ = nano_requests(args.requests, 1024)
    params = SamplingParams(temperature=0.6, max_tokens=args.output_len, ignore_eos=True)
    step, times = core.step, []

    def timed_step():
        started = time.perf_counter()
        outputs = step()
        times.append(time.perf_counter() - started)
        return outputs

    core.step = timed_step
    started = time.perf_counter()
    llm.generate(prompts, params)
    elapsed = time.perf_counter() - started
    decode = times[len(times) // 4 : -len(times) // 4]
    print(
        f"{args.requests} requests x {args.output_len} tokens: median decode step {statistics.median(decode) * 1e3:.2f} ms "
        f"on the host, generate outside step() {(elapsed - sum(times)) * 1e3 / len(times):.2f} ms per step "
        f"({len(times)} steps, {elapsed:.2f} s)"
    )


if __name__ == "__main__":
    main()
