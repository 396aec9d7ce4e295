"""The engine benchmark scripts run on a CPU with the ``tiny`` shapes and write the documented JSON keys
(every result: device, model, dtype, batch_size, input_len, output_len, decode_tokens_per_s, commit,
command, tp, num_gpus), through the setup they share in ``benchmarks/common.py``."""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
RESULT_KEYS = {
    "device",
    "model",
    "dtype",
    "batch_size",
    "input_len",
    "output_len",
    "decode_tokens_per_s",
    "commit",
    "command",
    "tp",
    "num_gpus",
}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def benchmarks(monkeypatch):
    """Run ``benchmarks/<script>.py`` as ``python benchmarks/<script>.py ARGS`` does, in this process."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setenv("FW_COMMIT", "abc1234")

    def run(script: str, *args: str) -> None:
        monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / script), *args])
        runpy.run_path(str(BENCHMARKS / script), run_name="__main__")

    return run


def test_decode_writes_one_result_per_case_with_the_documented_keys(benchmarks, tmp_path):
    out = tmp_path / "decode.json"
    benchmarks(
        "decode.py",
        "--shape",
        "tiny",
        "--batch",
        "1",
        "2",
        "--context",
        "16",
        "--steps",
        "3",
        "--dtype",
        "f32",
        "--out",
        str(out),
    )
    report = json.loads(out.read_text())
    assert (
        report["command"] == "python benchmarks/decode.py --shape tiny --batch 1 2 --context 16 --steps 3 --dtype f32"
    )
    assert (report["commit"], report["tp"], report["devices"], report["dtype"]) == ("abc1234", 1, [0], "f32")
    assert [(r["batch_size"], r["input_len"], r["output_len"]) for r in report["results"]] == [(1, 16, 3), (2, 16, 3)]
    for result in report["results"]:
        assert RESULT_KEYS <= set(result) and result["decode_tokens_per_s"] > 0
        assert (result["device"], result["model"], result["tp"], result["num_gpus"]) == (
            "cpu",
            "tiny shape, random weights",
            1,
            1,
        )


def test_gpu_suite_runs_decode_and_prefill_cases_with_the_documented_keys(benchmarks, tmp_path):
    out = tmp_path / "suite.json"
    benchmarks(
        "gpu_suite.py",
        "--shape",
        "tiny-moe",
        "--cases",
        "decode:2:12:4",
        "prefill:16",
        "--dtype",
        "f32",
        "--out",
        str(out),
    )
    results = json.loads(out.read_text())["results"]
    assert [r["case"] for r in results] == ["decode", "prefill"]
    for result in results:
        assert RESULT_KEYS <= set(result)
        assert (
            result["command"]
            == "python benchmarks/gpu_suite.py --shape tiny-moe --cases decode:2:12:4 prefill:16 --dtype f32"
        )
    assert (results[0]["batch_size"], results[0]["input_len"], results[0]["output_len"]) == (2, 12, 4)
    assert results[0]["decode_tokens_per_s"] > 0 and results[1]["prefill_tokens_per_s"] > 0


def test_gpu_suite_runs_the_mla_shape_over_the_latent_cache(benchmarks, tmp_path):
    """``tiny-mla`` (DeepSeek-V2's layers) checks on a CPU the script the H200 runs with ``deepseek-v2-lite``."""
    out = tmp_path / "mla.json"
    benchmarks("gpu_suite.py", "--shape", "tiny-mla", "--cases", "decode:2:12:4", "--dtype", "f32", "--out", str(out))
    report = json.loads(out.read_text())
    (result,) = report["results"]
    assert RESULT_KEYS <= set(result) and result["decode_tokens_per_s"] > 0
    assert "DeepseekV2ForCausalLM" in result["model"] and result["attention_backend"] == "torch"
    per_token = report["summary"]["kv_bytes"] / report["summary"]["kv_tokens"]
    assert per_token == 2 * (64 + 32) * 4  # two layers of kv_lora_rank + qk_rope_head_dim in fp32


def test_recorded_command_is_the_arguments_given_less_the_output_path(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from common import command_line

    script = str(BENCHMARKS / "gemv_bandwidth.py")
    assert (
        command_line([script, "--out", "/tmp/x.json", "--tp", "1", "2", "--out=/tmp/y.json", "--shape", "tiny"])
        == "python benchmarks/gemv_bandwidth.py --tp 1 2 --shape tiny"
    )
    assert (
        command_line([script, "--d", "0,1", "--disable-cuda-graph", "--note", "two words"])
        == "python benchmarks/gemv_bandwidth.py --d 0,1 --disable-cuda-graph --note 'two words'"
    )
    monkeypatch.setattr(sys, "argv", [script, "--rows", "8"])
    assert command_line() == "python benchmarks/gemv_bandwidth.py --rows 8"


def test_every_engine_option_is_a_benchmark_flag_with_fw_serves_name_and_default(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from common import BENCHMARK_DEFAULTS, add_engine_arguments

    from framework.engine.args import engine_fields

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    flags = {flag: action for action in parser._actions for flag in action.option_strings}
    defaults = vars(parser.parse_args([]))
    for name, (_, meta, default) in engine_fields().items():
        for flag in meta.extra["flags"][0].split("/") + list(meta.extra["flags"][1:]):
            assert flag in flags, f"{name}: {flag} is not a benchmark flag"
        dest = flags[meta.extra["flags"][0].split("/")[0]].dest
        expected = BENCHMARK_DEFAULTS.get(name, default)
        assert defaults[dest] == (not expected if meta.extra["negate"] else expected), name


def test_engine_flags_become_the_llm_arguments_fw_serve_would_build(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from common import add_engine_arguments, engine_kwargs

    from framework import EngineArgs
    from framework.errors import ConfigError

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    given = ["--d", "2,3", "--all-reduce", "symm_mem", "--no-async-scheduling", "--disable-cuda-graph"]
    given += ["--block-size", "32", "--kv-fraction", "0.5", "-q", "gguf"]
    assert engine_kwargs(parser.parse_args(given), model="/random/weights", max_num_seqs=8) == {
        "model": "/random/weights",
        "load_format": "dummy",
        "enable_prefix_caching": False,
        "async_scheduling": False,
        "dtype": "bf16",
        "enable_cuda_graphs": False,
        "all_reduce": "symm_mem",
        "device_ids": [2, 3],
        "block_size": 32,
        "kv_fraction": 0.5,
        "quantization": "gguf",
        "max_num_seqs": 8,
    }
    assert engine_kwargs(parser.parse_args(["--tp", "2"]))["tensor_parallel_size"] == 2
    assert engine_kwargs(parser.parse_args(["--d", "1"]))["device"] == "cuda:1"  # as fw serve --d 1
    assert EngineArgs.from_options(**engine_kwargs(parser.parse_args(["--dtype", "auto", "--load-format", "auto"])))
    assert engine_kwargs(parser.parse_args(["--dtype", "auto", "--load-format", "auto"])) == {
        "enable_prefix_caching": False
    }
    with pytest.raises(ConfigError, match="--max-num-seqs must be >= 1, got 0"):
        engine_kwargs(parser.parse_args(["--max-num-seqs", "0"]))
    with pytest.raises(ConfigError, match="--max-num-seqs is set by this benchmark"):  # not silently dropped
        engine_kwargs(parser.parse_args(["--max-num-seqs", "4"]), max_num_seqs=8)


def test_a_scripts_own_flag_keeps_its_meaning_beside_the_engine_flags(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from common import add_engine_arguments, engine_kwargs

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="the script's own model path")
    add_engine_arguments(parser)
    args = parser.parse_args(["--model", "/some/dir", "--max-model-len", "64"])
    assert args.model == "/some/dir" and "--m" not in parser._option_string_actions
    assert engine_kwargs(args) == {
        "load_format": "dummy",
        "dtype": "bf16",
        "enable_prefix_caching": False,
        "max_model_len": 64,
    }


def test_gemv_candidate_matches_f_linear_and_layer_shapes_follow_the_rank(benchmarks, capsys):
    """``gemv_bandwidth.py --check``: the triton_ops plugin's GEMV it times against cuBLAS equals
    ``F.linear`` (one row, elementwise and on tensor cores, and several; split K; under TRITON_INTERPRET=1 here)."""
    benchmarks("gemv_bandwidth.py", "--check")
    assert "fw_triton_ops.gemv matches F.linear" in capsys.readouterr().out
    from gemv_bandwidth import layer_shapes

    one, two = (
        dict((name, (n, k)) for name, n, k, _ in layer_shapes("llama3-8b", 1)),
        dict((name, (n, k)) for name, n, k, _ in layer_shapes("llama3-8b", 2)),
    )
    assert one == {
        "qkv": (6144, 4096),
        "o": (4096, 4096),
        "gate_up": (28672, 4096),
        "down": (4096, 14336),
        "lm_head": (128256, 4096),
    }
    assert two == {
        "qkv": (3072, 4096),
        "o": (4096, 2048),
        "gate_up": (14336, 4096),
        "down": (4096, 7168),
        "lm_head": (64128, 4096),
    }


def test_gguf_kernels_checks_and_times_every_case_and_writes_the_report(benchmarks, tmp_path, capsys):
    """``gguf_kernels.py --tiny``: the packed-GGUF kernels checked against the torch reference, then
    timed (interpreted here) beside dequantize+cuBLAS and the dense matmul, one result per case."""
    out = tmp_path / "gguf.json"
    benchmarks("gguf_kernels.py", "--tiny", "--types", "Q4_K", "Q8_0", "--out", str(out))
    report = json.loads(out.read_text())
    assert report["command"] == "python benchmarks/gguf_kernels.py --tiny --types Q4_K Q8_0" and report["tiny"]
    cases = [(r["type"], r["layer"], r["rows"]) for r in report["results"]]
    assert cases == [(t, layer, rows) for t in ("Q4_K", "Q8_0") for layer in ("qkv", "down") for rows in (1, 3, 17)]
    for result in report["results"]:
        assert result["check_rel_error"] < 1e-5 and result["rule_us"] > 0 and result["packed_bytes"] > 0
    assert "Q8_0   down" in capsys.readouterr().out


def test_nano_requests_are_nano_vllms_lengths_and_the_same_every_run(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from common import nano_requests

    prompts, output_lens = nano_requests(64, 50)
    lengths = [len(p["prompt_token_ids"]) for p in prompts]
    assert len(prompts) == len(output_lens) == 64
    assert all(100 <= n <= 1024 for n in lengths + output_lens) and len(set(lengths)) > 32
    assert all(0 <= t < 50 for p in prompts for t in p["prompt_token_ids"])
    assert nano_requests(64, 50) == (prompts, output_lens)
    assert nano_requests(8, 50)[0] == prompts[:8]  # the prompts come first: a shorter run shares them


def test_mla_attention_checks_the_triton_path_against_the_torch_reference(benchmarks, capsys):
    """``mla_attention.py --check``: the Triton forward it times gives the torch backend's output and cache
    (under TRITON_INTERPRET=1 here)."""
    benchmarks("mla_attention.py", "--check")
    assert capsys.readouterr().out.count("triton matches torch") == 2


def test_decode_attention_sweep_checks_fused_against_unfused_and_skips_surplus_splits(benchmarks, capsys):
    """``decode_attention_sweep.py --check``: the two paths it times give the same output and cache
    (default and swept settings, under TRITON_INTERPRET=1 here); the sweep gives no split an empty
    segment only."""
    benchmarks("decode_attention_sweep.py", "--check")
    assert "decode_attention with the new K/V matches store_kv + decode_attention" in capsys.readouterr().out
    from decode_attention_sweep import sweep_settings

    at_128 = {(s["block_n"], s["num_splits"]) for s in sweep_settings(128)}
    assert at_128 == {(32, 1), (32, 2), (32, 4), (64, 1), (64, 2), (128, 1)}
    assert len(sweep_settings(4096)) == 3 * 3 * 3 * 4


def test_kv_cache_dtypes_times_steady_decode_of_what_fits_on_a_scaled_budget(benchmarks, tmp_path, capsys):
    """``kv_cache_dtypes.py --cases many --many-steps N --layers L``: only the case asked for, the KV
    budget scaled by L / layers, N timed decode steps of the requests that fit, more of them for turbo4."""
    out = tmp_path / "kv.json"
    benchmarks(
        "kv_cache_dtypes.py",
        *("--shape", "tiny", "--dtype", "f32", "--dtypes", "auto", "turbo4", "--context", "192"),
        *("--requests", "12", "--mem", "4", "--layers", "1", "--cases", "many", "--many-steps", "3"),
        *("--out", str(out)),
    )
    report = json.loads(out.read_text())
    assert report["layers"] == 1 and report["mem_mb"] == 1  # tiny has 4 layers: 4 MB -> 1
    auto, turbo4 = report["results"]
    for result in (auto, turbo4):
        assert "batch1" not in result and "batch1_short" not in result
        assert result["many"]["steady_steps"] == 3 and result["many"]["output_tokens"] > 0
    assert turbo4["kv_tokens"] > auto["kv_tokens"]
    assert auto["many"]["most_running"] < 12 == turbo4["many"]["most_running"]  # 1 MB holds 5 of auto's
    assert "turbo4 many:" in capsys.readouterr().out  # printed as it comes


def test_kv_decode_kernels_checks_its_sweep_against_the_defaults(benchmarks, capsys):
    """``kv_decode_kernels.py --check``: the backend step, the kernel and the swept settings run on
    the quantized caches (under TRITON_INTERPRET=1 here) and agree with the default tiles."""
    benchmarks("kv_decode_kernels.py", "--check", "--dtypes", "fp8", "turbo4")
    printed = capsys.readouterr().out
    assert printed.count("3 settings run, 0 refused") == 2


def test_kernel_reports_carry_date_device_commit_command_and_versions(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setenv("FW_COMMIT", "abc1234")
    monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / "gemv_bandwidth.py"), "--rows", "1", "--out", "x.json"])
    from common import write_kernel_report

    write_kernel_report(str(tmp_path / "r.json"), [{"n": 1}], rows=2)
    report = json.loads((tmp_path / "r.json").read_text())
    assert {"date", "device", "torch", "triton"} <= set(report)
    assert (report["commit"], report["command"], report["rows"], report["results"]) == (
        "abc1234",
        "python benchmarks/gemv_bandwidth.py --rows 1",
        2,
        [{"n": 1}],
    )


def test_cpu_side_by_side_fits_the_chat_prompt_and_takes_medians(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import cpu_side_by_side as side

    encode = lambda text: list(range(len(text.split()) + 5))  # noqa: E731  (5 template tokens)
    assert len(side.chat_ids(encode, 40)) == 40 and len(side.chat_ids(encode, 6)) == 6
    runs = [
        {"engine": "fw", "rss_mb": rss, "ttft_s": t, "decode": {"1": d}}
        for rss, t, d in [(300, 0.5, 20.0), (310, 0.9, 25.0), (290, 0.4, 30.0)]
    ]
    assert side.median_row(runs) == {"engine": "fw", "runs": 3, "rss_mb": 300, "ttft_s": 0.5, "decode": {"1": 25.0}}
    assert side.run_llamacpp(tmp_path, tmp_path / "model.gguf", 8, 16, 1, "passive") is None  # not built: skipped
    assert side.child_env("passive")["OMP_WAIT_POLICY"] == "PASSIVE"
    assert side.child_env("inherit").get("OMP_WAIT_POLICY") == os.environ.get("OMP_WAIT_POLICY")


def test_w4a16_kernels_checks_and_times_every_case(benchmarks, tmp_path, monkeypatch):
    """``w4a16_kernels.py --tiny``: the fw_gptq W4A16 core checked against dequantize-then-matmul (interpreted
    here), then timed beside bf16 cuBLAS, one result per case."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "w4a16.json"
    benchmarks("w4a16_kernels.py", "--tiny", "--variants", "gptq4", "awq4", "gptq4-act", "--out", str(out))
    report = json.loads(out.read_text())
    assert report["command"] == "python benchmarks/w4a16_kernels.py --tiny --variants gptq4 awq4 gptq4-act"
    assert [(r["variant"], r["layer"], r["rows"]) for r in report["results"]] == [
        (v, layer, rows) for v in ("gptq4", "awq4", "gptq4-act") for layer in ("qkv", "down") for rows in (1, 3, 17)
    ]
    assert all(r["check_rel_error"] < 1e-4 and r["kernel_us"] > 0 for r in report["results"])
    one_row = [r for r in report["results"] if r["rows"] == 1]  # the integer GEMV too, against its own reference
    assert all(r["int8_gemv_us"] > 0 and r["int8_gemv_rel_error"] < 1e-4 for r in one_row)


def test_w4a16_kernels_checks_and_times_the_fp4_variants(benchmarks, tmp_path, monkeypatch):
    """``w4a16_kernels.py --tiny --variants nvfp4 mxfp4``: fw_fp4's dense kernels, same checks and keys."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "fp4.json"
    benchmarks("w4a16_kernels.py", "--tiny", "--variants", "nvfp4", "mxfp4", "--out", str(out))
    results = json.loads(out.read_text())["results"]
    assert [(r["variant"], r["layer"], r["rows"]) for r in results] == [
        (v, layer, rows) for v in ("nvfp4", "mxfp4") for layer in ("qkv", "down") for rows in (1, 3, 17)
    ]
    assert all(r["check_rel_error"] < 1e-4 and r["kernel_us"] > 0 for r in results)


@pytest.mark.parametrize("layout", ["modelopt", "compressed-tensors"])
def test_random_nvfp4_checkpoint_runs_in_fw_bench(benchmarks, tmp_path, monkeypatch, layout):
    """``random_nvfp4_checkpoint.py --tiny`` writes an NVFP4 folder in either layout that ``fw bench`` runs
    (on the CPU's torch path: the interpreted kernels have their own tests)."""
    from typer.testing import CliRunner

    from cli.main import build_app

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    benchmarks("random_nvfp4_checkpoint.py", "--tiny", "--layout", layout, "--dir", str(tmp_path / "m"))
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == layout
    args = ["bench", "--m", str(tmp_path / "m"), "--num-prompts", "1", "--input-len", "8", "--output-len", "2"]
    args += ["--device", "cpu", "--dtype", "bf16", "--output-json", str(tmp_path / "bench.json")]
    result = CliRunner().invoke(build_app(), args)
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "bench.json").read_text())["output_tokens"] == 2


@pytest.mark.parametrize(("shape", "method"), [("tiny", "gptq"), ("tiny-moe", "awq")])
def test_random_quantized_checkpoint_runs_in_fw_bench(benchmarks, tmp_path, shape, method):
    """``random_quantized_checkpoint.py`` writes a GPTQ / AWQ folder of a shape (MoE experts per expert) that ``fw bench`` runs."""
    from typer.testing import CliRunner

    from cli.main import build_app

    benchmarks("random_quantized_checkpoint.py", "--shape", shape, "--method", method, "--dir", str(tmp_path / "m"))
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == method
    result = CliRunner().invoke(
        build_app(),
        [
            "bench",
            "--m",
            str(tmp_path / "m"),
            "--num-prompts",
            "1",
            "--input-len",
            "8",
            "--output-len",
            "2",
            "--device",
            "cpu",
            "--dtype",
            "bf16",
            "--output-json",
            str(tmp_path / "bench.json"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "bench.json").read_text())["output_tokens"] == 2


def test_random_mxfp4_checkpoint_runs_in_fw_bench(benchmarks, tmp_path):
    """``random_mxfp4_checkpoint.py`` writes a gpt-oss folder with MXFP4 experts in gpt-oss's layout that ``fw bench`` runs."""
    from safetensors import safe_open
    from typer.testing import CliRunner

    from cli.main import build_app

    benchmarks("random_mxfp4_checkpoint.py", "--shape", "tiny-gpt-oss", "--dir", str(tmp_path / "m"))
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    with safe_open(str(tmp_path / "m" / "model-00001.safetensors"), "pt") as f:
        assert f.get_slice("model.layers.0.mlp.experts.gate_up_proj_blocks").get_shape() == [8, 128, 4, 16]
        assert f.get_slice("model.layers.0.mlp.experts.down_proj_scales").get_shape() == [8, 128, 2]
    args = ["bench", "--m", str(tmp_path / "m"), "--num-prompts", "1", "--input-len", "8", "--output-len", "2"]
    args += ["--device", "cpu", "--dtype", "bf16", "--output-json", str(tmp_path / "bench.json")]
    result = CliRunner().invoke(build_app(), args)
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(
    ("script", "fmt", "variant"), [("w4a16_kernels.py", "wna16", "awq"), ("fp8_kernels.py", "fp8", "block")]
)
def test_quantized_moe_kernels_check_and_time_both_forms(benchmarks, tmp_path, monkeypatch, script, fmt, variant):
    """``--moe --tiny``: the fw_gptq / fw_fp8 MoE kernel checked against the torch reference op
    (interpreted here), then timed, for one token (per pair) and 40 (sorted blocks)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "moe.json"
    benchmarks(script, "--moe", "--tiny", "--out", str(out))
    report = json.loads(out.read_text())
    assert report["format"] == fmt and report["moe_shape"] == [8, 2, 256, 128]
    assert [(r["variant"], r["tokens"]) for r in report["results"]] == [(variant, 1), (variant, 40)]
    assert all(r["check_rel_error"] < 1e-5 and r["rule_us"] > 0 for r in report["results"])
