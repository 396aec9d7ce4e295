"""The W4A16, FP8 and FP4 MoE kernels (``fw_gptq.kernels.moe``, ``fw_fp8.kernels.moe``,
``fw_fp4.kernels.fp4_moe``) on the GPU: ``python benchmarks/w4a16_kernels.py --moe`` /
``python benchmarks/fp8_kernels.py --moe`` / ``python benchmarks/w4a16_kernels.py --moe --variants nvfp4 mxfp4``.

    python benchmarks/w4a16_kernels.py --moe --out $OUT/w4a16_moe.json          # gptq, awq, act-order
    python benchmarks/fp8_kernels.py --moe --out $OUT/fp8_moe.json              # block FP8
    python benchmarks/w4a16_kernels.py --moe --tokens 1 8 --sweep --out $OUT/w4a16_moe_sweep.json
    python benchmarks/fp8_kernels.py --moe --tiny     # the script itself on a CPU (TRITON_INTERPRET=1)
    python benchmarks/w4a16_kernels.py --moe --variants nvfp4 mxfp4 [--tokens 1 8] [--sweep] --out $OUT/fp4_moe.json
    python benchmarks/w4a16_kernels.py --moe --variants mxfp4 --moe-shape gpt-oss-20b --tokens 1 64 [--sweep]

One MoE layer of the Qwen3-30B-A3B shape (128 experts, 8 per token, hidden 2048, expert width 768)
with random experts in the format's kernel layout (4-bit group 128: symmetric, with zero points,
act-order sorted by group, or groups looked up per input; block FP8 128x128; NVFP4 with a global
scale per expert, MXFP4 with rebased e8m0 scales). Per token count it checks the kernel against the torch reference op
in float32 (within bf16 tolerance), then times, replayed from a CUDA graph over copies of the stacks
that overflow the L2 (every call reads HBM): the kernel at its rule's setting, the bf16 Triton
``fused_moe`` on the dequantized stacks (what a bf16 model runs) and, where it is graph-safe (pairs
<= experts), the torch reference. Bandwidth is of the chosen experts' bytes (weights and scales).
``--sweep`` times a grid of ``MoEKernelConfig`` settings too and reports the fastest (FP4 at one
token: the one-token integer kernels' tiles, ``fw_fp4.kernels.fp4_moe_gemv``). FP4 at one token
on CUDA is those kernels (x and the activations rounded to int8 per 32). ``--moe-shape
gpt-oss-20b``: 32 experts, top-4, 2880 x 2880, random biases and the clamped SwiGLU (FP4 only).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import torch
from common import COPY_BANDWIDTH, copies_timer, write_kernel_report

from framework import ops
from framework.ops import PackedExperts

QWEN3_30B_A3B = (128, 8, 2048, 768)
GPT_OSS_20B = (32, 4, 2880, 2880)
MOE_SHAPES = {"qwen3-30b-a3b": QWEN3_30B_A3B, "gpt-oss-20b": GPT_OSS_20B}
TINY = (8, 2, 256, 128)
#: Bytes the chosen experts of the stack copies a timing cycles through must reach (several L2s).
COLD_BYTES = 256 * 2**20
#: ``--moe`` variants of w4a16_kernels.py: name -> (zero points, act-order)
WNA16_VARIANTS = {"gptq": (False, False), "awq": (True, False), "act-order": (True, "perm"), "g-idx": (True, "g_idx")}


def wna16_stack(experts, rows, cols, zeros, act_order, device, generator) -> PackedExperts:
    """Random 4-bit group-128 experts ``[E, rows, cols]`` in fw_gptq's MoE layout. ``act_order``:
    ``"perm"``, desc_act experts as the loader keeps them (sorted by group; a random ``perm``);
    ``"g_idx"``, groups looked up per input (what experts whose groups cannot be sorted keep)."""
    from fw_gptq.moe import dequantize_experts

    groups = cols // 128
    words = torch.randint(
        -(2**31), 2**31, (experts, cols // 8, rows), dtype=torch.int32, device=device, generator=generator
    )
    scales = torch.rand(experts, groups * rows, device=device, generator=generator) * 0.01 + 0.005
    zero = (
        torch.randint(0, 16, (experts, groups * rows), device=device, generator=generator).float()
        if zeros
        else torch.full((experts, groups * rows), 8.0, device=device)
    )
    last = (torch.arange(cols, device=device) // 128).float().expand(experts, cols)
    if act_order:  # a random permutation: of the inputs (perm) or of their groups (g_idx)
        source = torch.arange(cols, device=device).float() if act_order == "perm" else last[0]
        last = torch.stack([source[torch.randperm(cols, device=device, generator=generator)] for _ in range(experts)])
    side = torch.cat([scales, zero, last], dim=1).contiguous()
    grouping = {False: "g128", "perm": "perm128", "g_idx": "g_idx"}[act_order]
    perm_size = 128 if act_order == "perm" else None
    return PackedExperts(
        words,
        side,
        f"wna16:4bit:{grouping}",
        cols,
        functools.partial(dequantize_experts, 4, cols, rows, perm_group_size=perm_size),
    )


def fp8_stack(experts, rows, cols, device, generator) -> PackedExperts:
    """Random block-FP8 experts ``[E, rows, cols]`` in fw_fp8's MoE layout."""
    from fw_fp8.moe import decode_experts

    values = torch.randn(experts, rows, cols, device=device, generator=generator) * 100
    data = values.clamp(-448, 448).to(torch.float8_e4m3fn)  # torch < 2.12 casts |x| > 464 to NaN
    scales = torch.rand(experts, rows // 128, cols // 128, device=device, generator=generator) * 1e-4 + 1e-4
    return PackedExperts(
        data.view(torch.uint8), scales, "fp8:e4m3:128x128", cols, functools.partial(decode_experts, 128, 128)
    )


def fp4_stack(variant, experts, rows, cols, device, generator) -> PackedExperts:
    """Random FP4 experts ``[E, rows, cols]`` in fw_fp4's MoE layout: NVFP4 (``variant`` "nvfp4": e4m3
    scales in 64..128, a global scale of 1e-4 per expert) or MXFP4 (e8m0 scales around 2^-7, rebased)."""
    from fw_fp4.experts import dequantize_nvfp4_rows
    from fw_fp4.moe import dequantize_rows

    data = torch.randint(0, 256, (experts, rows, cols // 2), dtype=torch.uint8, device=device, generator=generator)
    if variant == "mxfp4":
        scales = torch.randint(118 + 14, 123 + 14, (experts, rows, cols // 32), device=device, generator=generator)
        return PackedExperts(data, scales.to(torch.uint8), "mxfp4", cols, dequantize_rows)
    scales = (64 + 64 * torch.rand(experts, rows, cols // 16, device=device, generator=generator)).to(
        torch.float8_e4m3fn
    )
    global_scales = torch.full((experts,), 1e-4, device=device)
    return PackedExperts(data, scales.view(torch.uint8), "nvfp4", cols, dequantize_nvfp4_rows, global_scales)


def _module(fmt: str):
    if fmt == "fp8":
        from fw_fp8.kernels import moe
    else:
        from fw_gptq.kernels import moe
    return moe


def sweep_settings(fmt: str, num_pairs: int, tokens: int = 0) -> list:
    if fmt == "fp4" and tokens == 1:  # fw_fp4's one-token integer kernels (fp4_moe_gemv.ONE_TOKEN_TILES)
        return [
            {"ONE_TOKEN": True, "BLOCK_N": n, "STEP": k, "num_warps": w, "num_stages": 2}
            for n, k, w in itertools.product((16, 32, 64), (128, 256, 512), (2, 4))
        ]
    if fmt == "fp4":  # fw_fp4's kernel: tiles as a dict (BLOCK_M stays the pairs' block)
        return [
            {"BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "num_stages": st}
            for n, k, w, st in itertools.product((32, 64, 128), (64, 128, 256), (4, 8), (2, 3, 4))
        ]
    config = _module(fmt).MoEKernelConfig
    sorted_ = num_pairs > 64
    return [
        config(
            sorted=sorted_,
            block_m=block_m,
            block_n=block_n,
            block_k=block_k,
            sub_k=sub_k,
            num_warps=warps,
            num_stages=stages,
        )
        for block_m, block_n, block_k, sub_k, warps, stages in itertools.product(
            (16, 32, 64) if sorted_ else (16,), (64, 128), (128, 256, 512), (64, 128), (4, 8), (2, 3, 4)
        )
        if block_k >= sub_k and (block_m <= 16 or num_pairs >= 4 * block_m)
    ]


def measure(fmt: str, variant: str, tokens: int, shape, sweep: bool, tiny: bool, device: str, generator) -> dict:
    moe = None if fmt == "fp4" else _module(fmt)
    experts, top_k, hidden_size, inter = shape
    dims = {"w1": (inter, hidden_size), "w3": (inter, hidden_size), "w2": (hidden_size, inter)}
    if fmt == "fp8":
        stacks = [fp8_stack(experts, r, c, device, generator) for r, c in dims.values()]
    elif fmt == "fp4":
        stacks = [fp4_stack(variant, experts, r, c, device, generator) for r, c in dims.values()]
    else:
        stacks = [wna16_stack(experts, r, c, *WNA16_VARIANTS[variant], device, generator) for r, c in dims.values()]
    stack_bytes = sum(s.data.nbytes + s.scales.nbytes for s in stacks)
    dtype = torch.float32 if tiny else torch.bfloat16  # the interpreter computes bf16 wrongly
    hidden = (torch.randn(tokens, hidden_size, device=device, generator=generator) * 0.5).to(dtype)
    logits = torch.randn(tokens, experts, device=device, generator=generator)
    topk_weights, topk_ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    activation = activation_fp32 = ops.PLAIN_SWIGLU
    if shape == GPT_OSS_20B:  # its expert biases and clamped SwiGLU
        biases = [torch.randn(experts, n, device=device, generator=generator) * 0.1 for n in (2 * inter, hidden_size)]
        activation_fp32 = ops.MoEActivation(*biases, swiglu_alpha=1.702, swiglu_limit=7.0)
        activation = activation_fp32._replace(w13_bias=biases[0].to(dtype), w2_bias=biases[1].to(dtype))
    chosen = torch.unique(topk_ids).numel()
    touched = chosen * stack_bytes // experts
    num_copies = 1 if tiny else min(16, max(2, -(-COLD_BYTES // touched)))
    copies = [stacks] + [
        [s._replace(data=s.data.clone(), scales=s.scales.clone()) for s in stacks] for _ in range(num_copies - 1)
    ]

    def run(copy, config=None):
        if fmt == "fp4" and config and config.get("ONE_TOKEN"):
            from fw_fp4.kernels.fp4_moe_gemv import one_token_moe

            tiles = {key: value for key, value in config.items() if key != "ONE_TOKEN"}
            return one_token_moe(hidden, *copy, topk_weights, topk_ids, activation, tiles=tiles)
        if fmt == "fp4":  # the rule (one token: the integer kernels, fp4_moe_gemv), or a swept setting
            from fw_fp4.kernels.fp4_moe import quantized_fused_moe

            return quantized_fused_moe(hidden, *copy, topk_weights, topk_ids, activation, tiles=config)
        if tiny and config is None:  # the rule's form, tiles as wide as the tiny shape (interpreter time)
            config = dataclasses.replace(moe.moe_config(tokens * top_k), block_n=128)
        return moe.quantized_fused_moe(hidden, *copy, topk_weights, topk_ids, config=config)

    reference = ops.quantized_fused_moe
    if fmt == "fp4" and tokens == 1:
        from fw_fp4.kernels.fp4_moe import one_token_default
        from fw_fp4.kernels.fp4_moe_gemv import one_token_reference

        if one_token_default(hidden, hidden_size, inter, None):  # x and the activations rounded to int8
            reference = one_token_reference
    exact = reference(hidden.float(), *stacks, topk_weights, topk_ids, activation_fp32)
    got = run(stacks).float()
    error = ((got - exact).abs().max() / exact.abs().max()).item()
    if not error <= (1e-5 if tiny else 3e-2):  # NaN fails too
        raise AssertionError(f"{fmt} {variant} MoE kernel, {tokens} tokens: relative error {error:.3g}")
    time_it = copies_timer(tiny)
    kernel_s = time_it(run, copies)
    result = {
        "format": fmt,
        "variant": variant,
        "tokens": tokens,
        "pairs": tokens * top_k,
        "experts_chosen": chosen,
        "touched_bytes": touched,
        "check_rel_error": error,
        "rule_us": kernel_s * 1e6,
        "rule_gb_s": touched / kernel_s / 1e9,
        "rule_copy_fraction": touched / kernel_s / COPY_BANDWIDTH,
    }
    if not tiny:
        from fw_triton_ops.fused_moe import fused_moe

        ids = torch.arange(experts, device=device)
        w13 = torch.cat([stacks[0].experts(ids, dtype), stacks[1].experts(ids, dtype)], dim=1)
        dense = [(w13, stacks[2].experts(ids, dtype))]
        result["bf16_fused_moe_us"] = (
            time_it(lambda w: fused_moe(hidden, *w, topk_weights, topk_ids, activation), dense) * 1e6
        )
        del dense, w13
        if tokens * top_k <= experts:  # the reference's gather path: graph-safe
            result["torch_reference_us"] = (
                time_it(lambda c: ops.quantized_fused_moe(hidden, *c, topk_weights, topk_ids, activation), copies) * 1e6
            )
    if sweep:
        settings, refused = [], []
        for config in sweep_settings(fmt, tokens * top_k, tokens):
            try:
                error = ((run(stacks, config).float() - got).abs().max() / got.abs().max()).item()
            except Exception as exc:  # noqa: BLE001 (Triton's OutOfResources and compile errors alike)
                refused.append({**_setting(config), "error": f"{type(exc).__name__}: {exc}"[:200]})
                continue
            if not error <= 0.05:  # NaN fails too
                refused.append({**_setting(config), "error": f"wrong result, relative error {error:.3g}"})
                continue
            settings.append({**_setting(config), "us": time_it(lambda c, config=config: run(c, config), copies) * 1e6})
        best = min(settings, key=lambda s: s["us"])
        result.update(best=best, best_gb_s=touched / (best["us"] / 1e6) / 1e9, settings=settings, refused=refused)
    return result


def _setting(config) -> dict:
    return dict(config) if isinstance(config, dict) else dict(config.__dict__)


def run_moe(args, fmt: str) -> None:
    """``--moe`` of w4a16_kernels.py (``fmt`` "wna16") or fp8_kernels.py ("fp8"): a table and the report."""
    tiny = args.tiny or not torch.cuda.is_available()
    device = "cpu" if tiny else "cuda"
    shape = TINY if tiny else MOE_SHAPES[getattr(args, "moe_shape", "qwen3-30b-a3b")]
    if shape == GPT_OSS_20B and fmt != "fp4":
        raise SystemExit("--moe-shape gpt-oss-20b: its MXFP4 / NVFP4 experts only (--variants nvfp4 mxfp4)")
    token_counts = [1, 40] if tiny else args.tokens  # per pair, and sorted 16-row blocks
    if fmt == "fp4":
        variants = list(args.variants)
    else:
        variants = ["block"] if fmt == "fp8" else (["awq"] if tiny else list(WNA16_VARIANTS))
    generator = torch.Generator(device).manual_seed(0)
    experts, top_k, hidden_size, inter = shape
    print(f"MoE {experts} experts, top-{top_k}, hidden {hidden_size}, width {inter}; {fmt}")
    print(
        f"{'variant':>9s} {'tokens':>6s} {'experts':>7s} {'kernel us':>10s} {'GB/s':>7s} {'copy%':>6s} "
        f"{'bf16 us':>8s} {'torch us':>9s} {'best us':>8s}"
    )
    results = []
    for variant, tokens in itertools.product(variants, token_counts):
        r = measure(fmt, variant, tokens, shape, args.sweep, tiny, device, generator)
        results.append(r)
        cells = [f"{r[key]:.1f}" if key in r else "-" for key in ("bf16_fused_moe_us", "torch_reference_us")]
        best = f"{r['best']['us']:.1f}" if "best" in r else "-"
        print(
            f"{variant:>9s} {tokens:6d} {r['experts_chosen']:7d} {r['rule_us']:10.1f} {r['rule_gb_s']:7.0f} "
            f"{100 * r['rule_copy_fraction']:5.1f}% {cells[0]:>8s} {cells[1]:>9s} {best:>8s}",
            flush=True,
        )
        if not tiny:
            torch.cuda.empty_cache()
    if args.out:
        write_kernel_report(
            args.out, results, copy_bandwidth=COPY_BANDWIDTH, tiny=tiny, moe_shape=list(shape), format=fmt
        )
        print(f"wrote {args.out}")
