"""The GPU benchmark scripts of this plugin run on a CPU: ``w4a16_kernels.py --tiny`` checks the
kernel against dequantize-then-matmul (interpreted) and writes one result per case, and
``random_quantized_checkpoint.py`` writes a folder ``fw bench`` runs (dense and MoE shapes)."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[4] / "benchmarks"


@pytest.fixture
def benchmarks(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setenv("FW_COMMIT", "abc1234")

    def run(script: str, *args: str) -> None:
        monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / script), *args])
        runpy.run_path(str(BENCHMARKS / script), run_name="__main__")

    return run


def test_w4a16_kernels_checks_and_times_every_case(benchmarks, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "w4a16.json"
    benchmarks("w4a16_kernels.py", "--tiny", "--variants", "gptq4", "awq4", "gptq4-act", "--out", str(out))
    report = json.loads(out.read_text())
    assert report["command"] == "python benchmarks/w4a16_kernels.py --tiny --variants gptq4 awq4 gptq4-act"
    assert [(r["variant"], r["layer"], r["rows"]) for r in report["results"]] == [
        (v, layer, rows) for v in ("gptq4", "awq4", "gptq4-act") for layer in ("qkv", "down") for rows in (1, 3, 17)]
    assert all(r["check_rel_error"] < 1e-4 and r["kernel_us"] > 0 for r in report["results"])


@pytest.mark.parametrize(("shape", "method"), [("tiny", "gptq"), ("tiny-moe", "awq")])
def test_random_quantized_checkpoint_runs_in_fw_bench(benchmarks, tmp_path, shape, method):
    from typer.testing import CliRunner

    from cli.main import build_app

    benchmarks("random_quantized_checkpoint.py", "--shape", shape, "--method", method, "--dir", str(tmp_path / "m"))
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == method
    result = CliRunner().invoke(build_app(), ["bench", "--m", str(tmp_path / "m"), "--num-prompts", "1", "--input-len",
                                              "8", "--output-len", "2", "--device", "cpu", "--dtype", "bf16",
                                              "--output-json", str(tmp_path / "bench.json")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "bench.json").read_text())["output_tokens"] == 2
