"""Where a decode step's time goes on the GPU: kernel time per step against wall time per step.

    python benchmarks/profile_step.py --shape llama3-8b --batch 1 --context 4096 --steps 32
    python benchmarks/profile_step.py --shape llama3-8b --tp 2 --all-reduce symm_mem   # rank 0 of two GPUs
    python benchmarks/profile_step.py --model /tmp/gguf/llama3-8b-Q4_K_M.gguf --prefill 512

Builds the shape with random weights (as ``decode.py`` does), reaches steady decode, then runs
``--steps`` engine steps under ``torch.profiler`` and prints: wall ms per step, GPU-busy ms per
step (the sum of kernel times; below the wall time means the device waits for the host), and the
kernels that take the most time. ``--prefill N`` profiles one N-token prefill step instead.
The engine flags (``--dtype``, ``--attention-backend``, ``--tp``, ...) are ``decode.py``'s.
"""

from __future__ import annotations

import argparse
import time

import torch
from common import (
    SHAPES,
    add_engine_arguments,
    add_random_requests,
    engine_kwargs,
    model_config,
    prefill_until_decode,
    random_prompt,
    run_engine_script,
    synchronize,
    write_model_folder,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prefill", type=int, default=0, help="profile one prefill of this many tokens instead")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--model", help="profile this model (a GGUF file, a folder) instead of a random --shape")
    add_engine_arguments(parser)  # --tp N / --d: tensor parallelism, rank 0's GPU is profiled
    args = parser.parse_args()

    from framework import LLM, SamplingParams

    folder = args.model or write_model_folder(model_config(args.shape))
    llm = LLM(
        **engine_kwargs(
            args,
            model=str(folder),
            **({"load_format": "auto"} if args.model else {}),
            max_num_seqs=max(args.batch, 1),
            max_model_len=max(args.context, args.prefill) + args.steps + 64,
        ),
    )
    core, vocab = llm.engine.core, llm.engine.model_config.vocab_size
    generator = torch.Generator().manual_seed(0)
    if args.prefill:
        for i in range(3):  # warm-up, then the profiled one
            core.add_request(
                f"p{i}", random_prompt(vocab, args.prefill, generator), SamplingParams(max_tokens=1, ignore_eos=True)
            )
            if i == 2:
                profiler = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                )
                profiler.start()
            started = time.perf_counter()
            core.run_until_done()
            synchronize()
        steps, wall = 1, time.perf_counter() - started
    else:
        params = SamplingParams(max_tokens=args.steps + 64, ignore_eos=True, temperature=0.0)
        add_random_requests(llm, "d", args.batch, args.context, params, generator)
        prefill_until_decode(core)
        for _ in range(8):
            core.step()
        profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        )
        profiler.start()
        started = time.perf_counter()
        for _ in range(args.steps):
            core.step()
        wall, steps = time.perf_counter() - started, args.steps
    profiler.stop()
    events = [e for e in profiler.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in events) / 1e3 / steps
    print(
        f"{args.model or args.shape} batch {args.batch} context {args.context}{f' prefill {args.prefill}' if args.prefill else ''}: "
        f"wall {wall * 1e3 / steps:.3f} ms/step, GPU busy {busy:.3f} ms/step (async {core.async_scheduling})"
    )
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[: args.top]:
        print(f"  {e.self_device_time_total / 1e3 / steps:8.3f} ms/step  {e.count / steps:6.1f}x  {e.key[:110]}")
    host = sorted(
        (e for e in profiler.key_averages() if e.device_type == torch.autograd.DeviceType.CPU),
        key=lambda e: -e.self_cpu_time_total,
    )[:12]
    for e in host:
        print(f"  host {e.self_cpu_time_total / 1e3 / steps:8.3f} ms/step  {e.count / steps:6.1f}x  {e.key[:90]}")
    llm.close()


if __name__ == "__main__":
    run_engine_script(main)
