"""The GGUF MoE kernel (``fw_gguf.kernels.moe``) on the GPU: ``python benchmarks/gguf_kernels.py --moe``.

    python benchmarks/gguf_kernels.py --moe --out $OUT/gguf_moe.json
    python benchmarks/gguf_kernels.py --moe --tokens 1 8 --sweep --out $OUT/gguf_moe_sweep.json
    python benchmarks/gguf_kernels.py --moe --tiny     # the script itself on a CPU (TRITON_INTERPRET=1)

One MoE layer of the Qwen3-30B-A3B shape (128 experts, 8 per token, hidden 2048, expert width 768)
as Q4_K_M files store it: Q4_K gate and up stacks, Q6_K down, planar per expert as the GPU keeps
them. Per token count it checks the kernel against the torch reference op (within bf16 tolerance
of float32 math), then times, replayed from a CUDA graph over copies of the stacks that fill
several times the L2 (every call reads HBM): the kernel at its static setting (``MOE_TUNED``, else
the rule), the bf16 Triton ``fused_moe`` on the dequantized stacks (what a bf16 model runs), and,
where it is graph-safe (pairs <= experts), the torch reference. Bandwidth is of the chosen
experts' packed bytes. ``--sweep`` times a grid of ``MoEKernelConfig`` settings too and prints
the fastest as ``MOE_TUNED`` entries. Routing: each token's 8 experts drawn at random (seeded).
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
from common import COPY_BANDWIDTH, copies_timer, write_kernel_report
from fw_gguf.dequant import dequantize
from fw_gguf.kernels.layout import experts_from_planar, experts_to_planar
from fw_gguf.kernels.moe import MoEKernelConfig, launch_setting, moe_config, pair_bucket, quantized_fused_moe
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from framework import ops
from framework.ops import PackedExperts

Q = GGMLQuantizationType
#: ``(experts, top_k, hidden, expert width)``; the --tiny stand-in is interpreted on a CPU.
QWEN3_30B_A3B = (128, 8, 2048, 768)
TINY = (8, 2, 256, 256)
TYPES = {"w1": Q.Q4_K, "w3": Q.Q4_K, "w2": Q.Q6_K}
#: Bytes the chosen experts of all the stack copies a timing cycles through must reach: several
#: times the H200's 50 MB L2, so every call reads HBM.
COLD_BYTES = 256 * 2**20


def random_stack(qtype, experts, rows, cols, device, generator) -> torch.Tensor:
    """``[E, rows, bytes]`` random blocks, every fp16 field about 1e-2 (values small, finite)."""
    from gguf_kernels import random_blocks  # the dense benchmark's block generator

    return random_blocks(qtype, experts * rows, cols, device, generator).view(experts, rows, -1)


def packed(data: torch.Tensor, qtype, cols: int) -> PackedExperts:
    rows = data.shape[1]

    def dequantize_rows(stack, scales, dtype):
        return dequantize(experts_from_planar(stack, qtype), qtype, (stack.shape[0] * rows, cols), dtype).view(
            -1, rows, cols
        )

    return PackedExperts(data, None, f"gguf-planar:{qtype.name}", cols, dequantize_rows)


def sweep_settings(num_pairs: int) -> list[MoEKernelConfig]:
    gemv = [
        MoEKernelConfig(1, gate_up, down, k_step, warps, 2)
        for gate_up, down, k_step, warps in itertools.product((16, 32, 64), (16, 32, 64), (256, 512), (4, 8))
    ]
    dot = [
        MoEKernelConfig(block_m, gate_up, down, 256, warps, stages)
        for block_m, gate_up, down, warps, stages in itertools.product(
            (16, 32, 64, 128), (32, 64, 128), (64, 128), (4, 8), (2, 3)
        )
        if block_m <= max(16, 1 << (num_pairs - 1).bit_length())
    ]
    return gemv + dot if num_pairs <= 64 else dot


def measure(tokens: int, shape, sweep: bool, tiny: bool, device: str, generator) -> dict:
    experts, top_k, hidden_size, inter = shape
    dims = {"w1": (inter, hidden_size), "w3": (inter, hidden_size), "w2": (hidden_size, inter)}
    stacks = {
        shard: experts_to_planar(random_stack(TYPES[shard], experts, rows, cols, device, generator), TYPES[shard])
        for shard, (rows, cols) in dims.items()
    }
    stack_bytes = sum(s.nbytes for s in stacks.values())
    dtype = torch.float32 if tiny else torch.bfloat16  # the interpreter computes bf16 wrongly
    hidden = (torch.randn(tokens, hidden_size, device=device, generator=generator) * 0.5).to(dtype)
    logits = torch.randn(tokens, experts, device=device, generator=generator)
    topk_weights, topk_ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    chosen = torch.unique(topk_ids).numel()
    touched = chosen * stack_bytes // experts
    num_copies = 1 if tiny else min(16, max(2, -(-COLD_BYTES // touched)))
    copies = [stacks] + [{k: v.clone() for k, v in stacks.items()} for _ in range(num_copies - 1)]

    def run(copy, config=None):
        w1, w3, w2 = (packed(copy[s], TYPES[s], dims[s][1]) for s in ("w1", "w3", "w2"))
        if tiny and config is None:  # the rule's form, in tiles as wide as the tiny shape (interpreter time)
            config = dataclasses.replace(moe_config(tokens * top_k), block_n_gate_up=inter, block_n_down=hidden_size)
        return quantized_fused_moe(hidden, w1, w3, w2, topk_weights, topk_ids, config=config)

    w1, w3, w2 = (packed(stacks[s], TYPES[s], dims[s][1]) for s in ("w1", "w3", "w2"))
    exact = ops.quantized_fused_moe(hidden.float(), w1, w3, w2, topk_weights, topk_ids)
    got = run(stacks).float()
    error = ((got - exact).abs().max() / exact.abs().max()).item()
    if error > (1e-5 if tiny else 3e-2):
        raise AssertionError(f"MoE kernel, {tokens} tokens: relative error {error:.3g} against float32 math")
    time_it = copies_timer(tiny)
    rule = launch_setting(w1, w2, tokens * top_k, torch.device(device))
    kernel_s = time_it(run, copies)
    result = {
        "tokens": tokens,
        "pairs": tokens * top_k,
        "experts_chosen": chosen,
        "touched_bytes": touched,
        "check_rel_error": error,
        "rule": rule.__dict__,
        "rule_us": kernel_s * 1e6,
        "rule_gb_s": touched / kernel_s / 1e9,
        "rule_copy_fraction": touched / kernel_s / COPY_BANDWIDTH,
    }
    if not tiny:
        from fw_triton_ops.fused_moe import fused_moe

        ids = torch.arange(experts, device=device)
        w13 = torch.cat([w1.experts(ids, dtype), w3.experts(ids, dtype)], dim=1)
        down = w2.experts(ids, dtype)
        dense = [(w13, down)]  # the chosen experts' bf16 rows already overflow the L2 from 1 token on
        result["bf16_fused_moe_us"] = (
            time_it(lambda w: fused_moe(hidden, w[0], w[1], topk_weights, topk_ids), dense) * 1e6
        )
        del dense, w13, down
        if tokens * top_k <= experts:  # the reference's gather path: graph-safe
            result["torch_reference_us"] = (
                time_it(
                    lambda c: ops.quantized_fused_moe(
                        hidden,
                        *(packed(c[s], TYPES[s], dims[s][1]) for s in ("w1", "w3", "w2")),
                        topk_weights,
                        topk_ids,
                    ),
                    copies,
                )
                * 1e6
            )
    if sweep:
        settings, refused = [], []
        for config in sweep_settings(tokens * top_k):
            try:
                error = ((run(stacks, config).float() - got).abs().max() / got.abs().max()).item()
            except Exception as exc:  # noqa: BLE001 (Triton's OutOfResources and compile errors alike)
                refused.append({**config.__dict__, "error": f"{type(exc).__name__}: {exc}"[:200]})
                continue
            if error > 0.05:
                refused.append({**config.__dict__, "error": f"wrong result, relative error {error:.3g}"})
                continue
            seconds = time_it(lambda c, config=config: run(c, config), copies)
            settings.append({**config.__dict__, "us": seconds * 1e6})
        best = min(settings, key=lambda s: s["us"])
        result.update(best=best, best_gb_s=touched / (best["us"] / 1e6) / 1e9, settings=settings, refused=refused)
    return result


def run_moe(args) -> None:
    """``gguf_kernels.py --moe``: every ``--tokens`` count of the shape, a table, and the report."""
    tiny = args.tiny or not torch.cuda.is_available()
    device = "cpu" if tiny else "cuda"
    shape = TINY if tiny else QWEN3_30B_A3B
    token_counts = [1, 40] if tiny else args.tokens  # the per-pair GEMV and 16-row blocks
    generator = torch.Generator(device).manual_seed(0)
    experts, top_k, hidden_size, inter = shape
    print(f"MoE {experts} experts, top-{top_k}, hidden {hidden_size}, width {inter}; gate/up Q4_K, down Q6_K")
    print(
        f"{'tokens':>6s} {'experts':>7s} {'kernel us':>10s} {'GB/s':>7s} {'copy%':>6s} {'bf16 us':>8s} "
        f"{'torch us':>9s} {'best us':>8s}"
    )
    results = []
    for tokens in token_counts:
        r = measure(tokens, shape, args.sweep, tiny, device, generator)
        results.append(r)
        cells = [f"{r[key]:.1f}" if key in r else "-" for key in ("bf16_fused_moe_us", "torch_reference_us")]
        best = f"{r['best']['us']:.1f}" if "best" in r else "-"
        print(
            f"{tokens:6d} {r['experts_chosen']:7d} {r['rule_us']:10.1f} {r['rule_gb_s']:7.0f} "
            f"{100 * r['rule_copy_fraction']:5.1f}% {cells[0]:>8s} {cells[1]:>9s} {best:>8s}",
            flush=True,
        )
        if not tiny:
            torch.cuda.empty_cache()
    if args.sweep:
        print("# fw_gguf.kernels.moe.MOE_TUNED entries (the sweep's fastest per case):")
        name = "cpu" if tiny else torch.cuda.get_device_name(0)
        for r in results:
            best = {key: value for key, value in r["best"].items() if key != "us"}
            print(
                f"    ({name!r}, 'Q4_K', 'Q6_K', {experts}, {hidden_size}, {inter}, {pair_bucket(r['pairs'])}): "
                f"MoEKernelConfig(**{best}),"
            )
    if args.out:
        write_kernel_report(
            args.out,
            results,
            copy_bandwidth=COPY_BANDWIDTH,
            tiny=tiny,
            moe_shape=list(shape),
            types={k: v.name for k, v in TYPES.items()},
        )


assert all(GGML_QUANT_SIZES[t][0] == 256 for t in TYPES.values())  # the tiny shape's 256 fits them
