"""fw and llama.cpp side by side on the same GGUF files of a real model shape (run on the GPU machine).

    python benchmarks/gguf_vs_llamacpp.py --shape llama3-8b --quants Q4_K_M Q8_0 --out $OUT/gguf.json
    python benchmarks/gguf_vs_llamacpp.py --shape qwen3-30b-a3b --quants Q4_K_M --cases decode:1:128:256 --out $OUT/gguf-moe.json
    python benchmarks/gguf_vs_llamacpp.py --shape tiny --skip-llamacpp --quants Q8_0 Q4_0 --dtype f32   # CPU check

A shape whose files take long to make splits over two calls (a machine keeps its /tmp between
calls while it stays warm): ``--workdir /tmp/gguf --files-only``, then ``--workdir /tmp/gguf --reuse``.

One call: write a random-weight GGUF of the shape (:mod:`gguf_files`: llama.cpp's layout and
metadata, a byte-level BPE vocabulary both engines load; F16 matrices, or Q8_0 for MoE shapes,
whose F16 file would not fit the GPU machine's disk beside its quantized copy), quantize it with
llama.cpp's ``llama-quantize`` to each of ``--quants`` (without llama.cpp: ``gguf.quants``, non-K
types only), then for each file

- llama.cpp: ``llama-bench -m FILE -p 512 -n 128 -fa 1 -r 3 -o json`` (prefill pp512, decode
  tg128 at batch 1), and ``llama-batched-bench`` (128 in / 128 out at batch 1 and 64) where built;
- fw: one engine on the same file (CUDA graphs, prefix cache off, EOS ignored) running the
  ``gpu_suite.py`` cases (default: batch 1 128 in / 256 out, batch 64 128/128, one 512-token
  prefill), with the memory its weights take on the device beside the file's size.

Writes one JSON (date, device, commit, command, both engines' numbers per file) and prints a table last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from common import SHAPES, add_engine_arguments, engine_kwargs, model_config, report_header, run_engine_script
from gguf import GGMLQuantizationType as Q
from gguf_files import PYTHON_QUANT_TYPES, requantize, write_random_gguf
from gpu_suite import parse_case, run_decode, run_prefill

DEFAULT_BIN = "/tmp/lcp/llama.cpp/build/bin"
DEFAULT_CASES = ["decode:1:128:256", "decode:64:128:128", "prefill:512"]


def make_files(args, config, workdir: Path) -> dict[str, Path]:
    """The GGUF file of each of ``--quants``: written, or quantized from the written source (with
    ``--reuse``, the files an earlier call left in ``--workdir`` are taken as they are)."""
    source_type = Q[args.source_type] if args.source_type != "auto" else (Q.Q8_0 if "num_experts" in config else Q.F16)
    targets = {name: workdir / f"{args.shape}-{name}.gguf" for name in args.quants}
    if args.reuse and all(path.is_file() for path in targets.values()):
        print(f"reusing {', '.join(path.name for path in targets.values())}", flush=True)
        return targets
    started = time.perf_counter()
    source = write_random_gguf(workdir / f"{args.shape}-{source_type.name}.gguf", config, source_type)
    print(
        f"wrote {source.name} ({source.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - started:.0f} s",
        flush=True,
    )
    quantize = Path(args.llamacpp_bin) / "llama-quantize"
    files = {}
    for name in args.quants:
        if name == source_type.name:
            files[name] = source
            continue
        target = targets[name]
        started = time.perf_counter()
        if not args.skip_llamacpp and quantize.exists():
            command = [str(quantize), "--allow-requantize", str(source), str(target), name, str(os.cpu_count() or 4)]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"llama-quantize {name} failed:\n{done.stderr[-2000:]}")
        elif name in Q.__members__ and Q[name] in PYTHON_QUANT_TYPES:
            requantize(source, target, Q[name])
        else:
            raise SystemExit(
                f"{name}: no llama-quantize at {quantize} (--llamacpp-bin) and gguf.quants makes only "
                f"{', '.join(t.name for t in PYTHON_QUANT_TYPES)}"
            )
        print(
            f"quantized {target.name} ({target.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - started:.0f} s",
            flush=True,
        )
        files[name] = target
    if source not in files.values() and not args.keep_files:
        source.unlink()  # the disk holds the quantized files, not the source too
    return files


def run_llamacpp(binaries: Path, path: Path, batches: list[int]) -> dict:
    """llama-bench's pp512 / tg128 and, where built, llama-batched-bench's decode speed per batch."""
    bench = [
        str(binaries / "llama-bench"),
        "-m",
        str(path),
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
    done = subprocess.run(bench, capture_output=True, text=True)
    if done.returncode:
        return {"command": " ".join(bench), "error": done.stderr[-2000:]}
    entries = json.loads(done.stdout)
    result = {
        "command": " ".join(bench),
        "llama_bench": entries,
        "model_size_bytes": entries[0].get("model_size") if entries else None,
    }
    for entry in entries:
        if entry.get("n_gen", 0) == 0:
            result["prefill_tokens_per_s"] = entry["avg_ts"]
        elif entry.get("n_prompt", 0) == 0:
            result["decode_tokens_per_s"] = entry["avg_ts"]
    batched = binaries / "llama-batched-bench"
    if batched.exists():
        command = [
            str(batched),
            "-m",
            str(path),
            "-c",
            str(max(batches) * 256 + 256),
            "-b",
            "2048",
            "-ub",
            "512",
            "-npp",
            "128",
            "-ntg",
            "128",
            "-npl",
            ",".join(map(str, batches)),
            "-fa",
            "on",
            "--output-format",
            "jsonl",
        ]
        done = subprocess.run(command, capture_output=True, text=True)
        lines = [json.loads(line) for line in (done.stdout + done.stderr).splitlines() if line.startswith("{")]
        result["batched_bench"] = {"command": " ".join(command), "rows": lines}
        result["batched_decode_tokens_per_s"] = {str(row["pl"]): row["speed_tg"] for row in lines}
    return result


def run_fw(args, path: Path, cases: list[tuple[str, list[int]]]) -> dict:
    """fw's engine on ``path``: each case's numbers, the summary, and the weights' device memory."""
    from framework import LLM

    longest = max([n[1] + n[2] for k, n in cases if k == "decode"] + [n[0] + 1 for k, n in cases if k == "prefill"])
    batch = max([n[0] for k, n in cases if k == "decode"] + [1])
    started = time.perf_counter()
    llm = LLM(
        **engine_kwargs(args, model=str(path), load_format="auto", max_num_seqs=batch, max_model_len=longest + 16)
    )
    build_s = time.perf_counter() - started
    results = []
    for kind, numbers in cases:
        result = run_decode(llm, *numbers) if kind == "decode" else run_prefill(llm, *numbers)
        results.append(result)
        shown = result.get("decode_tokens_per_s") or result.get("prefill_tokens_per_s")
        print(f"fw {path.name} {kind}:{':'.join(map(str, numbers))} -> {shown:,.1f} tok/s", flush=True)
    summary = dict(llm.engine.summary)
    llm.close()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"build_s": build_s, "weight_bytes": summary["weight_bytes"], "summary": summary, "results": results}


def table_rows(report: dict) -> list[tuple[str, str, float | None, float | None]]:
    """``(case, quant, llama.cpp tok/s, fw tok/s)`` per fw case, llama.cpp's number where it measured
    the same case (None where not); a file fw failed on gets llama.cpp's tg128 and pp512 alone."""
    rows = []
    for quant, entry in report["files"].items():
        lcp = entry.get("llamacpp") or {}
        if not entry["fw"]["results"]:  # fw failed on this file: llama.cpp's numbers alone
            rows += [
                ("decode batch 1 (tg128)", quant, lcp.get("decode_tokens_per_s"), None),
                ("prefill 512 (pp512)", quant, lcp.get("prefill_tokens_per_s"), None),
            ]
        for result in entry["fw"]["results"]:
            if result["case"] == "prefill":
                case, peer, ours = (
                    f"prefill {result['input_len']}",
                    lcp.get("prefill_tokens_per_s"),
                    result["prefill_tokens_per_s"],
                )
            else:
                batch = result["batch_size"]
                case = f"decode batch {batch}, {result['input_len']}/{result['output_len']}"
                peer = (
                    lcp.get("decode_tokens_per_s")
                    if batch == 1
                    else (lcp.get("batched_decode_tokens_per_s") or {}).get(str(batch))
                )
                ours = result["decode_tokens_per_s"]
            rows.append((case, quant, peer, ours))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--quants", nargs="+", default=["Q4_K_M", "Q8_0"], help="llama-quantize type names")
    parser.add_argument(
        "--source-type",
        default="auto",
        choices=["auto", "F16", "F32", "Q8_0"],
        help="how the random file is written (auto: F16, Q8_0 for MoE shapes)",
    )
    parser.add_argument(
        "--cases", nargs="+", default=DEFAULT_CASES, help="gpu_suite.py cases: decode:B:IN:OUT, prefill:IN"
    )
    parser.add_argument("--llamacpp-bin", default=DEFAULT_BIN, help="folder with llama-bench and llama-quantize")
    parser.add_argument("--skip-llamacpp", action="store_true", help="fw only (files quantized with gguf.quants)")
    parser.add_argument("--workdir", type=Path, help="where the GGUF files go (default: a new temporary folder)")
    parser.add_argument("--keep-files", action="store_true")
    parser.add_argument(
        "--reuse", action="store_true", help="take the files already in --workdir (from an earlier call)"
    )
    parser.add_argument(
        "--files-only",
        action="store_true",
        help="make the files in --workdir and stop (a later call with --reuse times them)",
    )
    add_engine_arguments(parser)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    cases = [parse_case(c) for c in args.cases]
    if any(kind == "nano" for kind, _ in cases):
        parser.error("nano cases are not run here: use gpu_suite.py")
    binaries = Path(args.llamacpp_bin)
    if not args.skip_llamacpp and not (binaries / "llama-bench").exists():
        parser.error(
            f"no llama-bench in {binaries}: build it (../shared/tools/llamacpp build cuda) or pass --skip-llamacpp"
        )
    config = model_config(args.shape)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="gguf-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if (args.reuse or args.files_only) and args.workdir is None:
        parser.error("--reuse and --files-only need --workdir")
    files = make_files(args, config, workdir)
    if args.files_only:
        return
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the random draws' cache: llama.cpp runs next, beside this process
    report = {
        **report_header(),
        "shape": args.shape,
        "model": f"{args.shape} shape ({config['architectures'][0]}), random weights",
        "dtype": args.dtype,
        "files": {},
    }
    decode_batches = sorted({n[0] for k, n in cases if k == "decode"})
    for quant, path in files.items():  # llama.cpp first: fw's engine would hold the GPU memory
        entry = report["files"][quant] = {"path": path.name, "file_bytes": path.stat().st_size}
        if not args.skip_llamacpp:
            entry["llamacpp"] = run_llamacpp(binaries, path, decode_batches)
    for quant, path in files.items():
        entry = report["files"][quant]
        try:
            entry["fw"] = run_fw(args, path, cases)
        except Exception as error:  # keep llama.cpp's numbers and the other files' results
            print(f"fw failed on {path.name}: {type(error).__name__}: {error}", flush=True)
            entry["fw"] = {"error": f"{type(error).__name__}: {error}", "results": []}
            continue
        entry["weights_over_file"] = entry["fw"]["weight_bytes"] / entry["file_bytes"]
    report["table"] = [
        dict(zip(("case", "quant", "llamacpp_tokens_per_s", "fw_tokens_per_s"), row)) for row in table_rows(report)
    ]
    if args.out:
        args.out.write_text(json.dumps(report, indent=2, default=str))
    if args.workdir is None and not args.keep_files:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"{args.shape} on {report['device']} (commit {report['commit']}, fw dtype {args.dtype})")
    for quant, entry in report["files"].items():
        if "error" in entry["fw"]:
            print(f"  {quant}: file {_size(entry['file_bytes'])}, fw failed: {entry['fw']['error']}")
            continue
        print(
            f"  {quant}: file {_size(entry['file_bytes'])}, fw weights {_size(entry['fw']['weight_bytes'])} "
            f"({entry['weights_over_file']:.2f}x the file)"
        )
    print(f"{'case':<30} {'quant':<8} {'llama.cpp':>10} {'fw':>10} {'fw/llama.cpp':>13}")
    for case, quant, peer, ours in table_rows(report):
        ratio = f"{ours / peer:.2f}x" if peer and ours else "-"
        print(f"{case:<30} {quant:<8} {_rate(peer):>10} {_rate(ours):>10} {ratio:>13}")


def _rate(tokens_per_s: float | None) -> str:
    return "-" if tokens_per_s is None else f"{tokens_per_s:.1f}"


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"


if __name__ == "__main__":
    run_engine_script(main)
