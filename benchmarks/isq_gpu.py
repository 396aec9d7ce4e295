"""``--isq`` on the GPU: load time against bf16, and decode speed against the same format from a file.

    python benchmarks/isq_gpu.py --shape llama3-8b --types q4k int4 fp8 --workdir /tmp/isq --out $OUT/isq-gpu.json
    python benchmarks/isq_gpu.py --shape tiny --types q8_0 int4 --workdir /tmp/isq-tiny --output-len 8   # CPU: the script

1. ``random_quantized_checkpoint.py --method bf16`` writes the shape's random bf16 checkpoint (the
   source); it is loaded once unquantized for the reference load time and decode speed.
2. Per ``--isq`` type the same folder is loaded with ``isq=TYPE``: ``load_s`` is the engine's own
   weight-loading time (the summary's ``load_s``: reading, quantizing and placing the weights; CUDA
   graph capture and KV sizing excluded), and the quantize seconds the ISQ report gives.
3. The same format from a file: the GGUF types from the file ``fw quantize --isq TYPE`` writes of the
   source; ``int4`` / ``int8`` from a random GPTQ checkpoint (symmetric, group 128: the layout ``--isq
   int4`` builds) and ``fp8`` from a random block-FP8 one (``random_quantized_checkpoint.py``), since
   speed does not depend on the values.

Decode: one request of ``--input-len`` random tokens generating ``--output-len`` (``gpu_suite.py``'s
``decode:1:IN:OUT`` case). Every engine uses the same flags (``--max-num-seqs`` 1 by default, so few
graphs are captured). The report gives, per type, ``load_s / bf16 load_s`` (aim: < 2) and ``isq
tok/s / file tok/s`` (aim: within 3 %).
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from common import SHAPES, add_engine_arguments, engine_kwargs, report_header, run_engine_script
from gpu_suite import run_decode

from framework import LLM

HERE = Path(__file__).resolve().parent
#: ``--isq`` types whose file comes from ``random_quantized_checkpoint.py`` (method, extra flags).
CHECKPOINT_FILES = {"int4": ("gptq", ["--bits", "4"]), "int8": ("gptq", ["--bits", "8"]), "fp8": ("fp8", [])}


def write_random_checkpoint(shape: str, method: str, folder: Path, extra: list[str] = ()) -> Path:
    if not (folder / "config.json").exists():
        command = [sys.executable, str(HERE / "random_quantized_checkpoint.py"), "--shape", shape]
        subprocess.run([*command, "--method", method, *extra, "--dir", str(folder)], check=True)
    return folder


def use_byte_level_tokenizer(folder: Path) -> None:
    """Give ``folder`` the byte-level BPE vocabulary of ``gguf_files`` (a GGUF file needs one)."""
    import tokenizers
    from gguf_files import vocabulary

    config = json.loads((folder / "config.json").read_text())
    tokens, _, merges, special = vocabulary(int(config["vocab_size"]))
    model = tokenizers.models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split(" ")) for m in merges])
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    tokenizer.save(str(folder / "tokenizer.json"))
    bos, eos = tokens[special["bos"]], tokens[special["eos"]]
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": bos, "eos_token": eos}))


def measure(args: argparse.Namespace, model: Path, isq: str | None) -> dict:
    """Build one engine on ``model`` (quantized at load with ``isq``) and time a batch-1 decode."""
    kwargs = engine_kwargs(args, model=str(model), max_num_seqs=args.max_num_seqs)
    kwargs["load_format"] = "auto"  # the folder's own weights, never random ones
    if isq:
        kwargs["isq"] = isq
    llm = LLM(**kwargs)
    try:
        summary = llm.engine.summary
        decode = run_decode(llm, 1, args.input_len, args.output_len)
        result = {
            "model": str(model),
            "isq": isq,
            "weight_format": summary.get("weight_format"),
            "load_s": summary["load_s"],
            "isq_report": summary.get("isq"),
            "weight_bytes": summary["weight_bytes"],
            "decode_tokens_per_s": decode["decode_tokens_per_s"],
        }
    finally:
        llm.close()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    label = f"--isq {isq}" if isq else "file"
    print(
        f"{model.name} {label}: load {result['load_s']:.1f} s, {result['decode_tokens_per_s']:,.1f} tok/s",
        flush=True,
    )
    return result


def file_of(args: argparse.Namespace, isq: str, source: Path) -> Path:
    """The checkpoint of ``isq``'s format loaded from disk (see the module docstring)."""
    if isq in CHECKPOINT_FILES:
        method, extra = CHECKPOINT_FILES[isq]
        return write_random_checkpoint(args.shape, method, args.workdir / f"file-{isq}", extra)
    from framework.isq import export_checkpoint

    target = args.workdir / f"fw-{isq}.gguf"
    if not target.exists():
        export_checkpoint(str(source), str(target), isq)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--types", nargs="+", default=["q4k", "int4", "fp8"])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=1)
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints written under --workdir")
    parser.add_argument("--out", type=Path)
    add_engine_arguments(parser)
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    source = write_random_checkpoint(args.shape, "bf16", args.workdir / "bf16")
    use_byte_level_tokenizer(source)
    bf16 = measure(args, source, None)
    rows = []
    for isq in args.types:
        at_load = measure(args, source, isq)
        file = file_of(args, isq, source)
        from_file = measure(args, file, None)
        rows.append(
            {
                "isq": isq,
                "at_load": at_load,
                "from_file": from_file,
                "load_vs_bf16": at_load["load_s"] / bf16["load_s"],
                "speed_vs_file": at_load["decode_tokens_per_s"] / from_file["decode_tokens_per_s"],
            }
        )
        if not args.keep:
            shutil.rmtree(file) if file.is_dir() else file.unlink(missing_ok=True)
    print(f"\nbf16: load {bf16['load_s']:.1f} s, {bf16['decode_tokens_per_s']:,.1f} tok/s")
    print("| --isq | load s (x bf16) | tok/s at load | tok/s from file | at load / file |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        print(
            f"| {row['isq']} | {row['at_load']['load_s']:.1f} ({row['load_vs_bf16']:.2f}x) "
            f"| {row['at_load']['decode_tokens_per_s']:,.1f} | {row['from_file']['decode_tokens_per_s']:,.1f} "
            f"| {row['speed_vs_file']:.3f} |"
        )
    if args.out:
        report = {**report_header(), "shape": args.shape, "bf16": bf16, "types": rows}
        args.out.write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    run_engine_script(main)
