"""Decode speed of fw's engine on random weights of a real model shape (run on the GPU machine).

    python benchmarks/decode.py --shape llama3-8b --batch 1 64 --context 128 4096 --out $OUT/decode.json
    python benchmarks/decode.py --shape llama3-8b --tp 2 --out $OUT/decode-tp2.json   # GPUs 0,1 (or --d 0,1)
    python benchmarks/decode.py --shape llama3-8b --tp 2 --all-reduce symm_mem --out $OUT/decode-tp2-symm.json
    python benchmarks/decode.py --shape qwen3-32b --tp 2 --batch 1 --context 128 --out $OUT/decode-32b-tp2.json
    python benchmarks/decode.py --shape qwen3-30b-a3b --batch 1 --context 128 --out $OUT/decode-moe.json
    python benchmarks/decode.py --shape deepseek-v2-lite --batch 1 8 --context 128 --out $OUT/decode-mla.json

For each case it builds the engine once (random weights through the model's own weight loaders,
``load_format="dummy"``), fills ``batch`` requests with ``context`` prompt tokens, then times
whole engine steps (schedule, inputs, graph replay, sampling, host ids) as the intervals between
successive returns of ``step()`` in steady decode, with no synchronisation of its own (so async
scheduling's overlap of step n + 1's preparation with step n counts, as it does for a user): the
median interval gives tokens/s (batch / interval) and the fraction of the roofline (weight bytes / device copy bandwidth, GPU.md: 4.28 TB/s on the H200).
With ``--tp N`` each GPU reads its shard, so the roofline uses one rank's weight bytes.
For MoE shapes the batch-1 roofline counts the bytes one token reads: the dense weights and
``top_k / num_experts`` of the experts. Prints a table last and writes the full JSON. On a CPU
(``--shape tiny`` or ``tiny-moe``) it runs the same steps, for checking the script itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    "qwen3-0.6b-like-llama": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                                  num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=8192),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=1024, max_position_embeddings=4096),
    # Qwen3-30B-A3B: 48 layers of 128 experts (top-8, width 768), QK norm
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
                          rms_norm_eps=1e-6, tie_word_embeddings=False),
    # DeepSeek-V2-Lite: MLA (kv_lora_rank 512, rope 64: 576 cached numbers per token and layer), 26 MoE layers
    # of 64 experts (top-6, width 1408) + 2 shared, 1 dense layer; YaRN x40
    "deepseek-v2-lite": dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", hidden_size=2048,
                             intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=64, n_shared_experts=2,
                             num_experts_per_tok=6, first_k_dense_replace=1, topk_method="greedy", n_group=1, topk_group=1,
                             routed_scaling_factor=1.0, norm_topk_prob=False, num_hidden_layers=27, num_attention_heads=16,
                             num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
                             qk_rope_head_dim=64, v_head_dim=128, vocab_size=102400, max_position_embeddings=163840,
                             rope_theta=10000.0, rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                                               "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                                                               "mscale_all_dim": 0.707}, rms_norm_eps=1e-6, tie_word_embeddings=False),
    # Llama-3-70B: 80 layers, 64 query / 8 KV heads, FFN 28672 (141 GB in bf16: TP=4 and up)
    "llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    # Qwen3-235B-A22B: 94 layers of 128 experts (top-8, width 1536), 64 query / 4 KV heads (470 GB in bf16: TP=8)
    "qwen3-235b-a22b": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=4096,
                            intermediate_size=12288, moe_intermediate_size=1536, num_experts=128, num_experts_per_tok=8,
                            norm_topk_prob=True, num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4,
                            head_dim=128, vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
                            rms_norm_eps=1e-6, tie_word_embeddings=False),
    # Qwen3-32B: 64 layers, 64 query / 8 KV heads of 128, FFN 25600, QK norm (65.5 GB in bf16)
    "qwen3-32b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=5120, intermediate_size=25600,
                      num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                      vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                      tie_word_embeddings=False),
    "tiny-moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=256, intermediate_size=512,
                     moe_intermediate_size=128, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
                     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1024,
                     max_position_embeddings=4096, tie_word_embeddings=False),
}
COPY_BANDWIDTH = 4.28e12  # bytes/s read+written, measured on the H200 (GPU.md)


def git_commit() -> str:
    """The checkout's commit; ``FW_COMMIT`` where the tree was copied without ``.git`` (GPU machine)."""
    import os

    if os.environ.get("FW_COMMIT"):
        return os.environ["FW_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except Exception:
        return "unknown"


def bytes_read_per_token(model) -> int:
    """Weight bytes a batch-1 decode step reads: every parameter but the embedding table (rows are
    gathered), and of each MoE layer's stacked experts only the ``top_k`` a token uses."""
    from framework.layers.fused_moe import FusedMoE

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    total -= embed.numel() * embed.element_size()
    for module in model.modules():
        if isinstance(module, FusedMoE):
            experts = sum(p.numel() * p.element_size() for p in (module.w13_weight, module.w2_weight))
            total -= experts - experts * module.top_k // module.num_experts
    return total


def run_case(llm, batch: int, context: int, steps: int, weight_bytes: int) -> dict:
    from framework import SamplingParams

    core = llm.engine.core
    vocab = llm.engine.model_config.vocab_size
    generator = torch.Generator().manual_seed(batch * 7919 + context)
    # requests that finish their prompt early decode while the others still prefill
    prefill_steps = -(-batch * context // llm.engine.core.config.scheduler.max_num_batched_tokens) + 1
    params = SamplingParams(max_tokens=steps + prefill_steps + 8, ignore_eos=True, temperature=0.0)
    for i in range(batch):
        core.add_request(f"b{batch}-c{context}-{i}", torch.randint(0, vocab, (context,), generator=generator).tolist(), params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.requests.values()):
        core.step()  # prefill (chunked) until every request decodes
    for _ in range(3):
        core.step()
    times = []
    wall = time.perf_counter()
    for _ in range(steps):
        outputs = core.step()  # returns host token ids: a step has finished on the device
        now = time.perf_counter()
        times.append(now - wall)
        wall = now
        assert len(outputs) == batch
    for request_id in list(core.requests):
        core.abort(request_id)
    step = statistics.median(times)
    return {"batch": batch, "context": context, "steps": steps, "median_step_ms": step * 1e3,
            "tokens_per_s": batch / step, "batch_size": batch, "input_len": context, "output_len": steps,
            "decode_tokens_per_s": batch / step, "roofline_tokens_per_s": COPY_BANDWIDTH / weight_bytes,
            "roofline_fraction": (batch / step) / (COPY_BANDWIDTH / weight_bytes) if batch == 1 else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=int, nargs="+", default=[128, 4096])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--disable-cuda-graph", action="store_true")
    parser.add_argument("--no-async-scheduling", action="store_true", help="read each step back before the next")
    parser.add_argument("--tp", type=int, default=None, help="tensor-parallel size (GPUs 0..N-1 unless --d)")
    parser.add_argument("--d", default=None, help="GPU ordinals, e.g. 0,1 (tensor parallelism over them)")
    parser.add_argument("--all-reduce", default="nccl", choices=["nccl", "symm_mem", "auto"],
                        help="tensor-parallel all-reduce (fw --all-reduce)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device_ids = [int(x) for x in args.d.split(",")] if args.d else list(range(args.tp)) if (args.tp or 1) > 1 else None
    tp = len(device_ids) if device_ids else 1

    from framework import LLM

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5, **SHAPES[args.shape]}
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(config))
    started = time.perf_counter()
    llm = LLM(str(folder), load_format="dummy", dtype=args.dtype, attention_backend=args.attention_backend,
              max_num_seqs=max(args.batch),
              max_model_len=max(args.context) + args.steps + 16 + max(args.batch) * max(args.context) // 8192,
              enable_cuda_graphs=not args.disable_cuda_graph, enable_prefix_caching=False,
              async_scheduling=False if args.no_async_scheduling else None, all_reduce=args.all_reduce,
              **({"device_ids": device_ids, "tensor_parallel_size": tp} if device_ids else {}))
    build_s = time.perf_counter() - started
    model = llm.engine.core.runner.model
    weight_bytes = bytes_read_per_token(model)
    results = [run_case(llm, b, c, args.steps, weight_bytes) for b in args.batch for c in args.context]
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    for result in results:  # the GPU issue's keys on every result (output_len: the timed decode steps)
        result.update(device=device, model=f"{args.shape} shape, random weights", dtype=args.dtype, tp=tp, num_gpus=tp,
                      commit=git_commit())
    report = {"date": time.strftime("%Y-%m-%d"), "device": device, "commit": git_commit(),
              "command": "python benchmarks/decode.py " + " ".join(
                  f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                  for k, v in vars(args).items() if k != "out" and v not in (None, False) and (k, v) != ("all_reduce", "nccl")),
              "shape": args.shape, "dtype": args.dtype, "tp": tp, "all_reduce": args.all_reduce, "devices": device_ids or [0],
              "weight_bytes": weight_bytes, "weight_bytes_note": "per rank" if tp > 1 else "whole model", "build_s": build_s,
              "summary": llm.engine.summary, "torch": torch.__version__, "results": results}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2, default=str))
    llm.close()
    print(f"{args.shape} {args.dtype} TP={tp} ({args.all_reduce} all-reduce) on {report['device']}: attention {llm.engine.attention_backend}, "
          f"graphs {llm.engine.summary.get('cuda_graphs')}, async {llm.engine.summary.get('async_scheduling')}, weights {weight_bytes / 1e9:.2f} GB, build {build_s:.0f} s")
    print(f"{'batch':>6} {'context':>8} {'step ms':>9} {'tok/s':>9} {'roofline':>9}")
    for r in results:
        frac = f"{r['roofline_fraction']:.0%}" if r["roofline_fraction"] else "-"
        print(f"{r['batch']:>6} {r['context']:>8} {r['median_step_ms']:>9.2f} {r['tokens_per_s']:>9.1f} {frac:>9}")


if __name__ == "__main__":
    main()
