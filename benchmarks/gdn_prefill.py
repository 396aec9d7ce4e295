"""The gated delta rule's prefill on the GPU: the chunked (WY) Triton kernels against the token-by-token
recurrent kernel they replace and the torch reference, at a shape's DeltaNet layer.

    python benchmarks/gdn_prefill.py --shape qwen3.5-27b qwen3.5-35b-a3b --steps 1x512 1x4096 8x512 1x16384 \
        --out $OUT/gdn-prefill.json

A step ``BxL`` is ``B`` fresh prompts of ``L`` tokens each in one call (bf16 q, k, v, beta; float32
g and states), as a prefill step of the engine packs them. For each implementation: seconds per call
(median of CUDA-event timings after warm-up), tokens per second, and the largest difference of its
outputs and final states from the torch reference's. ``--tp`` divides the heads as a rank holds them.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
from common import SHAPES, write_kernel_report
from fw_triton_ops.gated_delta_net import _recurrent_kernel, gated_delta_rule

from framework import ops_linear_attention as reference


def recurrent_prefill(q, k, v, g, beta, states, indices, use_qk_l2norm=True):
    """The previous prefill path: ``_recurrent_kernel`` walking each sequence token by token."""
    out = torch.empty_like(v)
    num_v, k_dim, v_dim = v.shape[1], q.shape[2], v.shape[2]
    table, block_v = indices.longer_table, min(32, triton.next_power_of_2(v_dim))
    _recurrent_kernel[(table.shape[0], num_v, triton.cdiv(v_dim, block_v))](
        q, k, v, g, beta, states, out, table[:, 0], table[:, 1], table[:, 2], table[:, 3], 4,
        q.stride(0), k.stride(0), v.stride(0), g.stride(0), out.stride(0), k_dim**-0.5,
        HEADS_PER_KEY=num_v // q.shape[1], NUM_V_HEADS=num_v, K_DIM=k_dim, V_DIM=v_dim,
        BLOCK_K=triton.next_power_of_2(k_dim), BLOCK_V=block_v, USE_QK_L2NORM=use_qk_l2norm, num_warps=4,
    )  # fmt: skip
    return out


IMPLEMENTATIONS = {"triton_chunked": gated_delta_rule, "triton_recurrent": recurrent_prefill, "torch": None}


def median_seconds(fn, repeats: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def measure(shape: str, tp: int, batch: int, length: int, repeats: int) -> list[dict]:
    c = SHAPES[shape]
    num_k, num_v = c["linear_num_key_heads"] // tp, c["linear_num_value_heads"] // tp
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    tokens, generator = batch * length, torch.Generator(device="cuda").manual_seed(0)

    def randn(*size):
        return torch.randn(*size, generator=generator, device="cuda").to(torch.bfloat16)

    q, k, v = randn(tokens, num_k, dk), randn(tokens, num_k, dk), randn(tokens, num_v, dv)
    g = -torch.rand(tokens, num_v, generator=generator, device="cuda") * 0.5
    beta = torch.rand(tokens, num_v, generator=generator, device="cuda").to(torch.bfloat16)
    cu = [i * length for i in range(batch + 1)]
    indices = reference.StateIndices.build(cu, list(range(batch)), [False] * batch, torch.device("cuda"))
    states = torch.zeros(batch, num_v, dk, dv, device="cuda")
    expected_states = states.clone()
    expected = reference.gated_delta_rule(q, k, v, g, beta, expected_states, indices)
    results = []
    for name, impl in IMPLEMENTATIONS.items():
        impl = impl or reference.gated_delta_rule
        out = impl(q, k, v, g, beta, states, indices)
        seconds = median_seconds(lambda impl=impl: impl(q, k, v, g, beta, states, indices), repeats)
        results.append({
            "shape": shape, "tp": tp, "batch_size": batch, "input_len": length, "implementation": name,
            "seconds": seconds, "tokens_per_s": tokens / seconds,
            "max_out_diff": (out.float() - expected.float()).abs().max().item(),
            "max_state_diff": (states - expected_states).abs().max().item(),
        })  # fmt: skip
        print(f"{shape} tp{tp} {batch}x{length} {name}: {seconds * 1e3:.3f} ms, {tokens / seconds:,.0f} tok/s")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", nargs="+", default=["qwen3.5-27b"], choices=sorted(SHAPES))
    parser.add_argument("--tp", type=int, nargs="+", default=[1])
    parser.add_argument("--steps", nargs="+", default=["1x512", "1x4096", "8x512"], help="BxL: B prompts of L tokens")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="JSON results file")
    args = parser.parse_args()
    results = []
    for shape in args.shape:
        for tp in args.tp:
            for step in args.steps:
                batch, length = (int(x) for x in step.split("x"))
                results += measure(shape, tp, batch, length, args.repeats)
    if args.out:
        write_kernel_report(args.out, results)


if __name__ == "__main__":
    main()
