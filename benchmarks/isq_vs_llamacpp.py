"""fw's ``--isq`` quantizers against ``llama-quantize`` on the same weights (run where llama.cpp is built).

    python benchmarks/isq_vs_llamacpp.py --shape qwen3-0.6b-like-llama --out $OUT/isq-vs-llamacpp.json

1. A random-weight F16 GGUF of the shape (``gguf_files.write_random_gguf``: llama.cpp's layout) is the source.
2. Per type (``--types``): ``llama-quantize --pure`` writes every matrix in that type; fw quantizes the
   same F16 tensors (on the GPU where there is one) to the type llama.cpp gave each tensor, and the
   report gives, per type, the share of identical blocks and both quantizers' relative RMS error.
3. The recipe: ``llama-quantize ... Q4_K_M`` against ``fw quantize --isq q4k`` of the same weights
   (the F16 file dequantized to an F16 Hugging Face folder, then written back as GGUF by fw): the
   tensor types must agree everywhere, and the bytes (the report counts the tensors that differ).
4. fw's file in llama.cpp: ``llama-bench`` loads and runs it, and ``llama-simple`` generates from it
   next to fw's greedy text on the same file.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch
from common import model_config, report_header
from fw_gguf.quantize import quantize
from fw_gguf.to_safetensors import write_hf_checkpoint
from gguf import GGMLQuantizationType as Q
from gguf_files import write_random_gguf

from framework import LLM, SamplingParams
from framework.isq import export_checkpoint

DEFAULT_BIN = "/tmp/lcp/llama.cpp/build/bin"
TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


def tensors(path: Path) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def as_float(tensor: gguf.ReaderTensor) -> np.ndarray:
    """A source tensor ``[rows, cols]`` in float32 (F16/F32 files only)."""
    return np.asarray(tensor.data, dtype=np.float32).reshape(tuple(int(d) for d in reversed(tensor.shape)))


def compare_tensor(source: np.ndarray, theirs: gguf.ReaderTensor, device: str) -> dict:
    qtype = Q(theirs.tensor_type)
    ours = quantize(torch.from_numpy(source).to(device), qtype).cpu().numpy()
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    their_bytes = np.asarray(theirs.data).reshape(ours.shape)
    same = (ours.reshape(-1, block_bytes) == their_bytes.reshape(-1, block_bytes)).all(-1)
    scale = float(source.std())

    def rel(blocks):
        return float(np.sqrt(((gguf.quants.dequantize(blocks, qtype) - source) ** 2).mean()) / scale)

    return {
        "type": qtype.name,
        "blocks": int(same.size),
        "identical_blocks": int(same.sum()),
        "fw_rel_rmse": rel(ours),
        "llamacpp_rel_rmse": rel(their_bytes),
    }


def llama_quantize(binaries: Path, src: Path, dst: Path, qtype: str, pure: bool) -> Path:
    command = [str(binaries / "llama-quantize"), *(["--pure"] if pure else []), str(src), str(dst), qtype]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return dst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-0.6b-like-llama")
    parser.add_argument("--types", nargs="+", default=TYPES)
    parser.add_argument("--llamacpp-bin", type=Path, default=Path(DEFAULT_BIN))
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--out")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    work = args.workdir or Path(tempfile.mkdtemp())
    work.mkdir(parents=True, exist_ok=True)
    source_file = write_random_gguf(work / "source-f16.gguf", model_config(args.shape), Q.F16)
    source = tensors(source_file)
    report = {**report_header(), "shape": args.shape, "per_type": {}, "recipe": {}}

    for qtype in args.types:
        theirs = tensors(llama_quantize(args.llamacpp_bin, source_file, work / f"pure-{qtype}.gguf", qtype, True))
        rows = [
            compare_tensor(as_float(source[name]), tensor, device)
            for name, tensor in theirs.items()
            if Q(tensor.tensor_type) not in (Q.F32, Q.F16)
        ]
        total = sum(r["blocks"] for r in rows)
        report["per_type"][qtype] = {
            "tensors": len(rows),
            "identical_block_share": sum(r["identical_blocks"] for r in rows) / total,
            "fw_rel_rmse": float(np.mean([r["fw_rel_rmse"] for r in rows])),
            "llamacpp_rel_rmse": float(np.mean([r["llamacpp_rel_rmse"] for r in rows])),
            "tensors_detail": rows,
        }
        print(qtype, {k: v for k, v in report["per_type"][qtype].items() if k != "tensors_detail"}, flush=True)

    reference = tensors(llama_quantize(args.llamacpp_bin, source_file, work / "llamacpp-Q4_K_M.gguf", "Q4_K_M", False))
    # float32: the F16 matrices exactly, and the F32 norms unrounded (llama-quantize copies them as they are)
    hf_dir = write_hf_checkpoint(source_file, work / "source-hf", dtype=torch.float32)
    written, isq_report = export_checkpoint(str(hf_dir), str(work / "fw-q4k.gguf"), "q4k", device)
    ours = tensors(written)
    type_mismatches = [n for n in reference if n in ours and reference[n].tensor_type != ours[n].tensor_type]
    byte_mismatches = [
        n
        for n in reference
        if n in ours and not np.array_equal(np.asarray(reference[n].data), np.asarray(ours[n].data))
    ]
    report["recipe"] = {
        "tensors": len(reference),
        "missing_in_fw": sorted(set(reference) - set(ours)),
        "type_mismatches": type_mismatches,
        "byte_mismatches": byte_mismatches,
        "fw_isq": isq_report.describe(),
    }
    print("Q4_K_M vs --isq q4k:", {k: (v if not isinstance(v, list) else len(v)) for k, v in report["recipe"].items()})

    bench = subprocess.run(
        [str(args.llamacpp_bin / "llama-bench"), "-m", str(written), "-p", "64", "-n", "16", "-r", "1", "-o", "json"],
        capture_output=True,
        text=True,
    )
    prompt = "The quick brown fox"
    simple = subprocess.run(
        [str(args.llamacpp_bin / "llama-simple"), "-m", str(written), "-n", "16", prompt],
        capture_output=True,
        text=True,
    )
    with LLM(str(written), device=device) as llm:
        fw_text = (
            llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0].text
        )
    report["llamacpp_loads_fw_file"] = {
        "llama_bench_rc": bench.returncode,
        "llama_bench": bench.stdout[-4000:],
        "llama_bench_stderr": bench.stderr[-2000:],
        "llama_simple_rc": simple.returncode,
        "llama_simple_output": simple.stdout[-2000:],
        "llama_simple_stderr": simple.stderr[-2000:],
        "fw_greedy_text": fw_text,
    }
    print("llama-bench rc", bench.returncode, "| llama-simple:", simple.stdout[-300:], "| fw:", fw_text)
    for done in (bench, simple):
        if done.returncode:
            print(done.args[0], "failed:", done.stderr[-1500:])
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
