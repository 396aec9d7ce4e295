"""``benchmarks/gguf_vs_llamacpp.py`` on a CPU: the tiny shape end to end on fw's side (files quantized
with gguf.quants), and llama.cpp's side through stand-in binaries that print what the real ones
print, so the commands, the parsing and the side-by-side table are checked before the GPU run."""

from __future__ import annotations

import json
import runpy
import stat
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def benchmark(monkeypatch):
    """Run ``python benchmarks/gguf_vs_llamacpp.py ARGS`` in this process."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setenv("FW_COMMIT", "abc1234")

    def run(*args: str) -> None:
        script = BENCHMARKS / "gguf_vs_llamacpp.py"
        monkeypatch.setattr(sys, "argv", [str(script), *args])
        runpy.run_path(str(script), run_name="__main__")

    return run


def test_tiny_shape_runs_fw_on_files_of_each_quant(benchmark, tmp_path, capsys):
    out, files = tmp_path / "gguf.json", tmp_path / "files"
    benchmark(
        "--shape",
        "tiny",
        "--skip-llamacpp",
        "--quants",
        "Q8_0",
        "Q4_0",
        "--cases",
        "decode:1:8:4",
        "prefill:16",
        "--dtype",
        "f32",
        "--workdir",
        str(files),
        "--keep-files",
        "--out",
        str(out),
    )
    report = json.loads(out.read_text())
    assert (report["commit"], report["device"], report["shape"]) == ("abc1234", "cpu", "tiny")
    assert report["command"].startswith("python benchmarks/gguf_vs_llamacpp.py --shape tiny --skip-llamacpp")
    assert list(report["files"]) == ["Q8_0", "Q4_0"]
    for quant, entry in report["files"].items():
        path = files / entry["path"]
        assert entry["file_bytes"] == path.stat().st_size
        reader = gguf.GGUFReader(path)
        types = {t.name: t.tensor_type for t in reader.tensors}
        assert (
            types["blk.3.ffn_down.weight"] == types["output.weight"] == Q[quant]
            and types["output_norm.weight"] == Q.F32
        )
        assert len(reader.fields["tokenizer.ggml.tokens"].data) == 1024  # the shape's vocabulary
        fw = entry["fw"]
        assert fw["summary"]["weight_format"] == "gguf" and fw["weight_bytes"] == fw["summary"]["weight_bytes"] > 0
        assert [r["case"] for r in fw["results"]] == ["decode", "prefill"]
        assert fw["results"][0]["decode_tokens_per_s"] > 0 and fw["results"][1]["prefill_tokens_per_s"] > 0
        assert "llamacpp" not in entry
    assert [(row["case"], row["quant"], row["llamacpp_tokens_per_s"]) for row in report["table"]] == [
        ("decode batch 1, 8/4", "Q8_0", None),
        ("prefill 16", "Q8_0", None),
        ("decode batch 1, 8/4", "Q4_0", None),
        ("prefill 16", "Q4_0", None),
    ]
    assert capsys.readouterr().out.splitlines()[-5].split() == ["case", "quant", "llama.cpp", "fw", "fw/llama.cpp"]


FAKE_QUANTIZE = """
import shutil, sys
open(sys.argv[0] + ".calls", "a").write(" ".join(sys.argv[1:]) + "\\n")
shutil.copy(sys.argv[-4], sys.argv[-3])  # ... SOURCE TARGET TYPE THREADS: a copy stands in for the quantized file
"""
FAKE_BENCH = """
import json, sys
open(sys.argv[0] + ".calls", "a").write(" ".join(sys.argv[1:]) + "\\n")
print(json.dumps([{"n_prompt": 512, "n_gen": 0, "avg_ts": 9334.5, "model_size": 123},
                  {"n_prompt": 0, "n_gen": 128, "avg_ts": 277.25, "model_size": 123}]))
"""
FAKE_BATCHED = """
import json, sys
open(sys.argv[0] + ".calls", "a").write(" ".join(sys.argv[1:]) + "\\n")
print("main: n_kv_max = 768 ...", file=sys.stderr)
for pl, speed in ((1, 270.0), (2, 512.5)):
    print(json.dumps({"pp": 128, "tg": 128, "pl": pl, "speed_pp": 1.0, "speed_tg": speed, "speed": 1.0}), file=sys.stderr)
"""


def fake_llamacpp(folder: Path) -> Path:
    """Stand-ins for llama-quantize, llama-bench and llama-batched-bench in ``folder``."""
    folder.mkdir()
    for name, body in (
        ("llama-quantize", FAKE_QUANTIZE),
        ("llama-bench", FAKE_BENCH),
        ("llama-batched-bench", FAKE_BATCHED),
    ):
        script = folder / name
        script.write_text(f"#!{sys.executable}\n{body}")
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return folder


def test_llamacpp_commands_and_numbers_sit_beside_fws(benchmark, tmp_path):
    binaries = fake_llamacpp(tmp_path / "bin")
    out, files = tmp_path / "gguf.json", tmp_path / "files"
    benchmark(
        "--shape",
        "tiny",
        "--llamacpp-bin",
        str(binaries),
        "--quants",
        "Q4_K_M",
        "--cases",
        "decode:1:8:4",
        "decode:2:8:4",
        "prefill:16",
        "--dtype",
        "f32",
        "--workdir",
        str(files),
        "--out",
        str(out),
    )
    report = json.loads(out.read_text())
    source, target = files / "tiny-F16.gguf", files / "tiny-Q4_K_M.gguf"
    assert (binaries / "llama-quantize.calls").read_text().split() == [
        "--allow-requantize",
        str(source),
        str(target),
        "Q4_K_M",
        (binaries / "llama-quantize.calls").read_text().split()[-1],
    ]
    assert not source.exists()  # only the quantized files stay on the disk
    assert (binaries / "llama-bench.calls").read_text().split() == [
        "-m",
        str(target),
        "-p",
        "512",
        "-n",
        "128",
        "-fa",
        "1",
        "-r",
        "3",
        "-o",
        "json",
    ]
    batched = (binaries / "llama-batched-bench.calls").read_text().split()
    assert batched[batched.index("-npl") + 1] == "1,2" and batched[batched.index("--output-format") + 1] == "jsonl"
    lcp = report["files"]["Q4_K_M"]["llamacpp"]
    assert (lcp["prefill_tokens_per_s"], lcp["decode_tokens_per_s"], lcp["batched_decode_tokens_per_s"]) == (
        9334.5,
        277.25,
        {"1": 270.0, "2": 512.5},
    )
    fw = report["files"]["Q4_K_M"]["fw"]["results"]
    assert [(row["case"], row["llamacpp_tokens_per_s"], row["fw_tokens_per_s"]) for row in report["table"]] == [
        ("decode batch 1, 8/4", 277.25, fw[0]["decode_tokens_per_s"]),
        ("decode batch 2, 8/4", 512.5, fw[1]["decode_tokens_per_s"]),
        ("prefill 16", 9334.5, fw[2]["prefill_tokens_per_s"]),
    ]


def test_files_made_in_one_call_are_timed_in_the_next(benchmark, tmp_path):
    files, out = tmp_path / "files", tmp_path / "gguf.json"
    common = ["--shape", "tiny", "--skip-llamacpp", "--quants", "Q8_0", "--workdir", str(files)]
    benchmark(*common, "--files-only")
    made = files / "tiny-Q8_0.gguf"
    assert sorted(p.name for p in files.iterdir()) == ["tiny-Q8_0.gguf"] and not out.exists()
    made.touch()
    stamp = made.stat().st_mtime_ns
    benchmark(*common, "--reuse", "--cases", "decode:1:8:2", "--dtype", "f32", "--out", str(out))
    assert made.stat().st_mtime_ns == stamp  # taken as it was, not written again
    entry = json.loads(out.read_text())["files"]["Q8_0"]
    assert entry["file_bytes"] == made.stat().st_size and entry["fw"]["results"][0]["decode_tokens_per_s"] > 0


def test_fw_failing_on_a_file_keeps_llamacpps_numbers(benchmark, tmp_path, monkeypatch, capsys):
    import framework

    def broken_engine(*args, **kwargs):
        raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture")

    monkeypatch.setattr(framework, "LLM", broken_engine)
    out = tmp_path / "gguf.json"
    benchmark(
        "--shape",
        "tiny",
        "--llamacpp-bin",
        str(fake_llamacpp(tmp_path / "bin")),
        "--quants",
        "Q4_K_M",
        "--cases",
        "decode:1:8:4",
        "--dtype",
        "f32",
        "--out",
        str(out),
    )
    entry = json.loads(out.read_text())["files"]["Q4_K_M"]
    assert entry["fw"]["error"] == "RuntimeError: Cannot copy between CPU and CUDA tensors during CUDA graph capture"
    assert entry["llamacpp"]["decode_tokens_per_s"] == 277.25
    assert capsys.readouterr().out.splitlines()[-2:] == [
        f"{'decode batch 1 (tg128)':<30} {'Q4_K_M':<8} {'277.2':>10} {'-':>10} {'-':>13}",
        f"{'prefill 512 (pp512)':<30} {'Q4_K_M':<8} {'9334.5':>10} {'-':>10} {'-':>13}",
    ]


def test_q8_0_blocks_drawn_on_the_device_are_gguf_quants_bytes(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from gguf_files import quantize_q8_0, vocabulary

    values = torch.randn(48, 256, generator=torch.Generator().manual_seed(3)) * torch.logspace(-3, 1, 48).unsqueeze(1)
    values[5, :32] = 0  # an all-zero block has scale 0
    assert np.array_equal(quantize_q8_0(values).numpy(), gguf.quants.quantize(values.numpy(), Q.Q8_0))
    tokens, types, merges, special = vocabulary(128256)
    assert len(tokens) == len(set(tokens)) == len(types) == 128256
    assert (special, types[128000], types[127999]) == ({"bos": 128000, "eos": 128001}, 3, 1)
    assert all(set(m.replace(" ", "")) <= set(tokens[:256]) for m in merges)
