"""What the engine benchmarks share: model shapes on random weights, engine flags, prompts, steady decode.

``decode.py``, ``gpu_suite.py`` and ``profile_step.py`` build their engines with it;
``host_overhead.py`` and ``cpu_side_by_side.py`` take the model folder and the commit from it.
The scripts that write JSON results take their ``commit`` and ``command`` from it (:func:`git_commit`,
:func:`command_line`), the kernel benchmarks their CUDA-graph timer (:func:`graph_time`); ``serving.py``, a client of a running server, stands alone.
The scripts run as ``python benchmarks/<script>.py``, which puts this directory on ``sys.path``.
Nothing here needs a GPU: on a CPU the ``tiny``, ``tiny-moe``, ``tiny-hybrid`` and ``tiny-mla`` shapes check the scripts themselves.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

#: Model shapes (Hugging Face ``config.json`` fields) for random-weight engines. A shape without
#: ``architectures`` is a Llama (see :func:`model_config`).
SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    ),
    "qwen3-0.6b-like-llama": dict(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=8192,
    ),
    "tiny": dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
        max_position_embeddings=4096,
    ),
    # Qwen3-30B-A3B: 48 layers of 128 experts (top-8, width 768), QK norm
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    # Llama 4 Scout (17B active, 16 experts top-1 + a shared expert on every layer; chunked attention
    # on 3 of 4 layers, NoPE on the 4th) with 20 of its 48 layers: ~92 GB of bf16 weights, one H200
    "llama4-scout-20l": dict(
        architectures=["Llama4ForCausalLM"],
        model_type="llama4_text",
        hidden_size=5120,
        intermediate_size=8192,
        intermediate_size_mlp=16384,
        num_local_experts=16,
        num_experts_per_tok=1,
        interleave_moe_layer_step=1,
        num_hidden_layers=20,
        num_attention_heads=40,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=202048,
        max_position_embeddings=262144,
        attention_chunk_size=8192,
        no_rope_layer_interval=4,
        use_qk_norm=True,
        attn_temperature_tuning=True,
        floor_scale=8192,
        attn_scale=0.1,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=16.0,
            low_freq_factor=1.0,
            high_freq_factor=1.0,
            original_max_position_embeddings=8192,
        ),
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    # DeepSeek-V2-Lite: MLA (kv_lora_rank 512, rope 64: 576 cached numbers per token and layer), 26 MoE layers
    # of 64 experts (top-6, width 1408) + 2 shared, 1 dense layer; YaRN x40
    "deepseek-v2-lite": dict(
        architectures=["DeepseekV2ForCausalLM"],
        model_type="deepseek_v2",
        hidden_size=2048,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        n_routed_experts=64,
        n_shared_experts=2,
        num_experts_per_tok=6,
        first_k_dense_replace=1,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=False,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        vocab_size=102400,
        max_position_embeddings=163840,
        rope_theta=10000.0,
        rope_scaling={
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    # GLM-4.7-Flash (30B-A3B): MLA (kv_lora_rank 512, rope 64: 576 cached numbers per token and layer), 1 dense
    # layer then 46 MoE layers of 64 experts (top-4, width 1536) + 1 shared, DeepSeek-V3's sigmoid router (60 GB bf16)
    "glm-4.7-flash": dict(
        architectures=["Glm4MoeLiteForCausalLM"],
        model_type="glm4_moe_lite",
        hidden_size=2048,
        intermediate_size=10240,
        moe_intermediate_size=1536,
        n_routed_experts=64,
        n_shared_experts=1,
        num_experts_per_tok=4,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.8,
        norm_topk_prob=True,
        num_hidden_layers=47,
        mlp_layer_types=["dense"] + ["sparse"] * 46,
        num_attention_heads=20,
        num_key_value_heads=20,
        kv_lora_rank=512,
        q_lora_rank=768,
        qk_nope_head_dim=192,
        qk_rope_head_dim=64,
        v_head_dim=256,
        vocab_size=154880,
        max_position_embeddings=202752,
        rope_theta=1000000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    # Llama-3-70B: 80 layers, 64 query / 8 KV heads, FFN 28672 (141 GB in bf16: TP=4 and up)
    "llama3-70b": dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    ),
    # Qwen3-235B-A22B: 94 layers of 128 experts (top-8, width 1536), 64 query / 4 KV heads (470 GB in bf16: TP=8)
    "qwen3-235b-a22b": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        hidden_size=4096,
        intermediate_size=12288,
        moe_intermediate_size=1536,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        num_hidden_layers=94,
        num_attention_heads=64,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    # Qwen3-32B: 64 layers, 64 query / 8 KV heads of 128, FFN 25600, QK norm (65.5 GB in bf16)
    "qwen3-32b": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        hidden_size=5120,
        intermediate_size=25600,
        num_hidden_layers=64,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    # gpt-oss-20b: 24 layers (sliding 128 / full alternating), 64 query / 8 KV heads of 64 with sinks,
    # 32 experts of 2880 (top-4, MXFP4 in its checkpoint), YaRN x32 (write it with random_mxfp4_checkpoint.py)
    "gpt-oss-20b": dict(
        architectures=["GptOssForCausalLM"],
        model_type="gpt_oss",
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        num_local_experts=32,
        num_experts_per_tok=4,
        vocab_size=201088,
        sliding_window=128,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        attention_bias=True,
        swiglu_limit=7.0,
        tie_word_embeddings=False,
    ),
    "tiny-gpt-oss": dict(
        architectures=["GptOssForCausalLM"],
        model_type="gpt_oss",
        hidden_size=128,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=512,
        sliding_window=16,
        max_position_embeddings=4096,
        attention_bias=True,
        tie_word_embeddings=False,
    ),
    # Qwen3.5-27B's text model: 64 layers, Gated DeltaNet and gated attention 3:1 (48 + 16), 24 query /
    # 4 KV heads of 256, DeltaNet 16 key / 48 value heads of 128, FFN 17408 (about 54 GB in bf16)
    "qwen3.5-27b": dict(
        architectures=["Qwen3_5ForCausalLM"],
        model_type="qwen3_5_text",
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=64,
        full_attention_interval=4,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        vocab_size=248320,
        max_position_embeddings=262144,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    # Qwen3.5-35B-A3B's text model: 40 layers (30 DeltaNet + 10 attention), 256 experts (top-8, width
    # 512) and a gated shared expert (512) on every layer, 16 query / 2 KV heads of 256, DeltaNet 16 key /
    # 32 value heads of 128
    "qwen3.5-35b-a3b": dict(
        architectures=["Qwen3_5MoeForCausalLM"],
        model_type="qwen3_5_moe_text",
        hidden_size=2048,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        num_experts=256,
        num_experts_per_tok=8,
        num_hidden_layers=40,
        full_attention_interval=4,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        vocab_size=248320,
        max_position_embeddings=262144,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    # a CPU check of the scripts on a hybrid model (3 DeltaNet layers, 1 attention layer)
    "tiny-hybrid": dict(
        architectures=["Qwen3_5ForCausalLM"],
        model_type="qwen3_5_text",
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        vocab_size=1024,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False,
    ),
    "tiny-moe": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_experts=16,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=1024,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
    "qwen2.5-0.5b": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
    ),
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
    ),
}
# a CPU check of the scripts on multi-head latent attention (DeepSeek-V2-Lite's layers, "mla" KV layout)
SHAPES["tiny-mla"] = {k: v for k, v in SHAPES["deepseek-v2-lite"].items() if k != "rope_scaling"} | dict(
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=32,
    v_head_dim=32,
    vocab_size=1024,
    max_position_embeddings=4096,
)
COPY_BANDWIDTH = 4.28e12  # bytes/s read+written, measured on the H200 (GPU.md)


def model_config(shape: str) -> dict[str, Any]:
    """The ``config.json`` of ``shape``: its fields over a Llama's architecture, type and norm epsilon."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5, **SHAPES[shape]}


def write_model_folder(config: dict[str, Any]) -> Path:
    """A new temporary folder holding only ``config.json``: what ``load_format="dummy"`` fills with random weights."""
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def git_commit() -> str:
    """The checkout's commit; ``FW_COMMIT`` where the tree was copied without ``.git`` (GPU machine)."""
    if os.environ.get("FW_COMMIT"):
        return os.environ["FW_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except Exception:
        return "unknown"


def command_line(argv: list[str] | None = None) -> str:
    """The results' ``command``: ``python benchmarks/<script>.py`` with the arguments it was run with
    (``argv``, default ``sys.argv``), less ``--out PATH`` (the output path is the machine's, not
    part of the setup). Options left out took their defaults at the results' ``commit``."""
    argv = sys.argv if argv is None else argv
    kept, rest = [], iter(argv[1:])
    for arg in rest:
        if arg == "--out":
            next(rest, None)
        elif not arg.startswith("--out="):
            kept.append(arg)
    return shlex.join(["python", f"benchmarks/{Path(argv[0]).name}", *kept])


def device_name() -> str:
    """The GPU's name (the results' ``device``), ``"cpu"`` without CUDA."""
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def synchronize() -> None:
    """Wait for the device before reading a clock (nothing to wait for on a CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def graph_time(fn, repeats: int = 20, rounds: int = 5) -> float:
    """Seconds per call of ``fn`` on the GPU, replayed ``repeats`` times inside one CUDA graph (best
    of ``rounds``): kernel time without Python launch cost, as a decode step's graph runs it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / repeats)
    return best


def time_kernel_settings(run, settings, expected, copies, time_it, packed_bytes: int) -> dict:
    """A kernel benchmark's ``--sweep``: ``run(weight, config)`` at each of ``settings``, checked against
    ``expected`` (a setting that fails to compile or launch, or is off by more than 5 % of the largest
    output, is reported in ``refused``, not timed), the rest timed with ``time_it`` over ``copies``.
    Returns ``best``, ``best_gb_s`` (``packed_bytes`` at the best time), ``settings`` and ``refused``."""
    timed, refused = [], []
    for config in settings:
        try:  # a setting may need more shared memory than an SM has: report it, time the rest
            got = run(copies[0], config).double()
        except Exception as exc:  # noqa: BLE001 (Triton's OutOfResources and compile errors alike)
            refused.append({**config, "error": f"{type(exc).__name__}: {exc}"[:200]})
            continue
        if (got - expected).abs().max() > 0.05 * expected.abs().max():
            refused.append({**config, "error": "wrong result"})
            continue
        seconds = time_it(lambda w, config=config: run(w, config), copies)
        timed.append({**config, "us": seconds * 1e6})
    best = min(timed, key=lambda s: s["us"])
    return {"best": best, "best_gb_s": packed_bytes / (best["us"] / 1e6) / 1e9, "settings": timed, "refused": refused}


def copies_timer(on_cpu: bool):
    """``time(fn, copies) -> seconds per call of fn(copy)`` for the kernel benchmarks: on the GPU
    :func:`graph_time` cycling through ``copies`` (weight copies that overflow the L2, so every call
    reads HBM); on the CPU (``on_cpu``: the scripts checking themselves) one timed call."""
    import itertools
    import time

    def cuda_time(fn, copies):
        calls = itertools.cycle(copies)
        return graph_time(lambda: fn(next(calls)), repeats=max(20, len(copies)))

    def cpu_time(fn, copies):
        start = time.perf_counter()
        fn(copies[0])
        return time.perf_counter() - start

    return cpu_time if on_cpu else cuda_time


def bytes_read_per_token(model, config: dict[str, Any]) -> int:
    """Weight bytes a batch-1 decode step reads: every parameter (and a quant method's buffers) but the embedding table (rows are
    gathered), and of each MoE layer's stacked experts only the ``top_k`` a token uses. A model
    whose ``config`` ties the embeddings reads the whole table once more, as its LM head."""
    from framework.layers.fused_moe import FusedMoE

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    # packed quantized weights a quant method keeps as buffers (fw_gptq's kernel layout, ...)
    total += sum(
        b.numel() * b.element_size()
        for module in model.modules()
        if getattr(module, "quant_method", None) is not None
        for b in module.buffers(recurse=False)
    )
    embed = model.model.embed_tokens.weight
    if not config.get("tie_word_embeddings"):
        total -= embed.numel() * embed.element_size()
    for module in model.modules():
        if isinstance(module, FusedMoE):
            # the stacked expert tensors, whatever the quant method names them (w13_weight, gguf_w1, blocks, scales, ...)
            stacked = [p for p in module.parameters(recurse=False) if p.dim() and p.shape[0] == module.num_experts]
            experts = sum(p.numel() * p.element_size() for p in stacked)
            total -= experts - experts * module.top_k // module.num_experts
    return total


# --- engine flags and construction ---------------------------------------------------------------


#: The benchmarks' measurement setup, where a flag does not say otherwise: random weights
#: (``load_format="dummy"`` over a ``config.json``), bf16, and the prefix cache off (every prompt is computed).
BENCHMARK_DEFAULTS: dict[str, Any] = {"load_format": "dummy", "dtype": "bf16", "enable_prefix_caching": False}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per :class:`~framework.engine.args.EngineArgs` field, spelled and documented as
    ``fw serve`` spells it (:func:`cli.options.with_engine_options`), defaulting to the field's
    default except for :data:`BENCHMARK_DEFAULTS`. A flag the script declared itself before this
    call keeps the script's meaning (the engine's option of that name is left out).
    :func:`engine_kwargs` turns the values into ``LLM`` arguments."""
    from cli.options import cli_option_name
    from framework.engine.args import engine_fields

    group, dests = parser.add_argument_group("engine options (as fw serve)"), []
    for name, (base, meta, default) in engine_fields().items():
        extra, dest = meta.extra, cli_option_name(name)
        default = BENCHMARK_DEFAULTS.get(name, default)
        help = argparse.SUPPRESS if extra["hidden"] else meta.description.replace("%", "%%")
        try:
            if extra["negate"]:  # enable_x <-> --disable-x
                group.add_argument(*extra["flags"], dest=dest, action="store_true", default=not default, help=help)
            elif "/" in extra["flags"][0]:  # --x/--no-x
                on, off = extra["flags"][0].split("/")
                group.add_argument(on, dest=dest, action="store_const", const=True, default=default, help=help)
                group.add_argument(off, dest=dest, action="store_const", const=False, help=argparse.SUPPRESS)
            elif base is bool:
                action = argparse.BooleanOptionalAction
                group.add_argument(*extra["flags"], dest=dest, action=action, default=default, help=help)
            else:
                kind = next((t for t in (int, float) if base in (t, t | None)), str)  # str: also --d 0,1
                group.add_argument(*extra["flags"], dest=dest, type=kind, default=default, help=help)
        except argparse.ArgumentError:  # the script's own flag of that name
            continue
        dests.append(dest)
    parser.set_defaults(engine_option_defaults={dest: parser.get_default(dest) for dest in dests})


def engine_kwargs(args: argparse.Namespace, **overrides: Any) -> dict[str, Any]:
    """``LLM`` keyword arguments from the flags of :func:`add_engine_arguments` and the script's
    ``overrides`` (its model folder, sizes from its own flags), validated as ``fw serve`` validates
    them; only the options that differ from :class:`EngineArgs`' defaults.

    Raises :class:`~framework.errors.ConfigError` for a bad value, and for a flag the user gave
    that the script sets itself (it would be ignored)."""
    from cli.options import EngineOptions, cli_option_name
    from framework.engine.args import engine_fields, flag_of
    from framework.errors import ConfigError

    defaults = args.engine_option_defaults
    values = {dest: getattr(args, dest) for dest in defaults}
    for name in overrides:
        dest = cli_option_name(name)
        if dest in values and values[dest] != defaults[dest]:
            raise ConfigError(f"{flag_of(name)} is set by this benchmark (from its own options); leave it out")
    engine_args = EngineOptions(values).args(**overrides)
    field_defaults = {name: default for name, (_, _, default) in engine_fields().items()}
    return {name: value for name, value in engine_args.to_dict().items() if value != field_defaults[name]}


def run_engine_script(main: Any) -> None:
    """Run an engine script's ``main``: a refused engine option (:class:`~framework.errors.ConfigError`)
    ends it with the message and exit status 2, as argparse ends a bad flag, not a traceback."""
    from framework.errors import ConfigError

    try:
        main()
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


def device_ids(args: argparse.Namespace) -> list[int] | None:
    """The GPUs of a tensor-parallel run (``--d``, else ``0..--tp - 1``); ``None`` for one device."""
    if args.device_ids:
        return [int(x) for x in args.device_ids.split(",")]
    tp = args.tensor_parallel_size or 1
    return list(range(tp)) if tp > 1 else None


def tensor_parallel_size(args: argparse.Namespace) -> int:
    """How many GPUs ``--tp`` / ``--d`` spread the engine over (1 without them)."""
    devices = device_ids(args)
    return len(devices) if devices else 1


# --- requests -------------------------------------------------------------------------------------


def report_header(device: str | None = None) -> dict[str, str]:
    """The keys every results JSON starts with: date, device (default :func:`device_name`), commit,
    command and the torch version; ``FW_KERNELS`` too where it forces kernels (part of the command)."""
    import os
    import time

    forced = {"FW_KERNELS": os.environ["FW_KERNELS"]} if os.environ.get("FW_KERNELS") else {}
    return {
        "date": time.strftime("%Y-%m-%d"),
        "device": device or device_name(),
        "commit": git_commit(),
        "command": command_line(),
        "torch": torch.__version__,
    } | forced


def write_kernel_report(path: str, results: list, **extra: Any) -> None:
    """Write a kernel benchmark's JSON to ``path``: :func:`report_header`, the Triton version,
    ``extra`` (the run's own settings) and ``results``."""
    import triton

    report = {**report_header(), "triton": triton.__version__, **extra, "results": results}
    with open(path, "w") as f:
        json.dump(report, f, indent=2)


def nano_requests(num_requests: int, vocab: int) -> tuple[list[dict[str, list[int]]], list[int]]:
    """nano-vllm's bench.py requests: prompts of ids below ``vocab`` and output lengths, both
    uniform in 100..1024, from ``random.Random(0)`` (the prompts first, then the lengths)."""
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randint(100, 1024))]} for _ in range(num_requests)
    ]
    return prompts, [rng.randint(100, 1024) for _ in range(num_requests)]


def random_prompt(vocab: int, length: int, generator: torch.Generator) -> list[int]:
    """``length`` token ids drawn uniformly from the vocabulary."""
    return torch.randint(0, vocab, (length,), generator=generator).tolist()


def add_random_requests(llm, prefix: str, batch: int, length: int, params, generator: torch.Generator) -> list[str]:
    """Add ``batch`` requests ``{prefix}-{i}`` of ``length`` random prompt tokens to ``llm``'s engine core; their ids."""
    core, vocab = llm.engine.core, llm.engine.model_config.vocab_size
    ids = [f"{prefix}-{i}" for i in range(batch)]
    for request_id in ids:
        core.add_request(request_id, random_prompt(vocab, length, generator), params)
    return ids


def prefill_until_decode(core) -> None:
    """Step the engine core until every request has computed its whole prompt (chunked prefill;
    requests that finish their prompt early already decode meanwhile)."""
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.requests.values()):
        core.step()
