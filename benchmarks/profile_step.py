"""Where a decode step's time goes on the GPU: kernel time per step against wall time per step.

    python benchmarks/profile_step.py --shape llama3-8b --batch 1 --context 4096 --steps 32
    python benchmarks/profile_step.py --shape llama3-8b --tp 2 --all-reduce symm_mem   # rank 0 of two GPUs

Builds the shape with random weights (as ``decode.py`` does), reaches steady decode, then runs
``--steps`` engine steps under ``torch.profiler`` and prints: wall ms per step, GPU-busy ms per
step (the sum of kernel times; below the wall time means the device waits for the host), and the
kernels that take the most time. ``--prefill N`` profiles one N-token prefill step instead.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from decode import SHAPES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prefill", type=int, default=0, help="profile one prefill of this many tokens instead")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--tp", type=int, default=1, help="tensor parallelism over GPUs 0..N-1 (rank 0's GPU is profiled)")
    parser.add_argument("--all-reduce", default="nccl", choices=["nccl", "symm_mem", "auto"])
    parser.add_argument("--no-async-scheduling", action="store_true")
    args = parser.parse_args()

    from framework import LLM, SamplingParams

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5, **SHAPES[args.shape]}
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(config))
    llm = LLM(str(folder), load_format="dummy", dtype="bf16", max_num_seqs=max(args.batch, 1),
              max_model_len=max(args.context, args.prefill) + args.steps + 64, enable_prefix_caching=False,
              async_scheduling=False if args.no_async_scheduling else None, all_reduce=args.all_reduce,
              **({"device_ids": list(range(args.tp)), "tensor_parallel_size": args.tp} if args.tp > 1 else {}))
    core, vocab = llm.engine.core, llm.engine.model_config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompt = lambda n: torch.randint(0, vocab, (n,), generator=generator).tolist()  # noqa: E731
    if args.prefill:
        for i in range(3):  # warm-up, then the profiled one
            core.add_request(f"p{i}", prompt(args.prefill), SamplingParams(max_tokens=1, ignore_eos=True))
            if i == 2:
                profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                              torch.profiler.ProfilerActivity.CUDA])
                profiler.start()
            started = time.perf_counter()
            core.run_until_done()
            torch.cuda.synchronize()
        steps, wall = 1, time.perf_counter() - started
    else:
        params = SamplingParams(max_tokens=args.steps + 64, ignore_eos=True, temperature=0.0)
        for i in range(args.batch):
            core.add_request(f"d{i}", prompt(args.context), params)
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.requests.values()):
            core.step()
        for _ in range(8):
            core.step()
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
        profiler.start()
        started = time.perf_counter()
        for _ in range(args.steps):
            core.step()
        wall, steps = time.perf_counter() - started, args.steps
    profiler.stop()
    events = [e for e in profiler.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in events) / 1e3 / steps
    print(f"{args.shape} batch {args.batch} context {args.context}{f' prefill {args.prefill}' if args.prefill else ''}: "
          f"wall {wall * 1e3 / steps:.3f} ms/step, GPU busy {busy:.3f} ms/step (async {core.async_scheduling})")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:args.top]:
        print(f"  {e.self_device_time_total / 1e3 / steps:8.3f} ms/step  {e.count / steps:6.1f}x  {e.key[:110]}")
    host = sorted((e for e in profiler.key_averages() if e.device_type == torch.autograd.DeviceType.CPU),
                  key=lambda e: -e.self_cpu_time_total)[:12]
    for e in host:
        print(f"  host {e.self_cpu_time_total / 1e3 / steps:8.3f} ms/step  {e.count / steps:6.1f}x  {e.key[:90]}")
    llm.close()
    if not torch.cuda.is_available():
        return
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    print(f"8192^3 bf16 matmul: {10 * 2 * 8192 ** 3 / (time.perf_counter() - started) / 1e12:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
