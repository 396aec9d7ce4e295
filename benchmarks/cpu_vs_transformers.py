"""CPU decode speed of fw against transformers on the same GGUF model, prompt and length.

    python benchmarks/cpu_vs_transformers.py --batch 1 8 --new-tokens 64 --out docs/benchmarks/x.json

Both load the same file (fw: the gguf plugin, weights dequantized once at load on CPU;
transformers: ``from_pretrained(gguf_file=...)``, dequantized to fp32), both fp32, greedy with
EOS ignored. Timed after a warm-up: decode tokens/s = batch * new tokens / (total - prefill time).
Prints a table last and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from common import report_header

PROMPT = "Write a short story about a robot who learns to paint."


def time_fw(path: Path, batch: int, new_tokens: int) -> dict:
    from framework import LLM, SamplingParams

    llm = LLM(str(path), device="cpu", enable_cuda_graphs=False)
    prompt = {"prompt_token_ids": llm.tokenizer.encode(PROMPT)}
    llm.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True, temperature=0))
    prefill_params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
    started = time.perf_counter()
    llm.generate([prompt] * batch, prefill_params)
    prefill = time.perf_counter() - started
    llm.engine.core.kv_cache.reset_prefix_cache()
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0)
    started = time.perf_counter()
    out = llm.generate([prompt] * batch, params)
    total = time.perf_counter() - started
    assert all(len(r.outputs[0].token_ids) == new_tokens for r in out)
    return {
        "engine": "fw",
        "batch": batch,
        "total_s": total,
        "prefill_s": prefill,
        "decode_tokens_per_s": batch * (new_tokens - 1) / (total - prefill),
    }


def time_transformers(path: Path, batch: int, new_tokens: int) -> dict:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ids = torch.tensor([tokenizer(PROMPT)["input_ids"]] * batch)
    kwargs = dict(do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kwargs)
        started = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        prefill = time.perf_counter() - started
        started = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        total = time.perf_counter() - started
    assert out.shape[1] == ids.shape[1] + new_tokens
    return {
        "engine": "transformers " + transformers.__version__,
        "batch": batch,
        "total_s": total,
        "prefill_s": prefill,
        "decode_tokens_per_s": batch * (new_tokens - 1) / (total - prefill),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from framework.loader.source import default_model_path

    path = args.model or default_model_path()
    rows = []
    for batch in args.batch:
        rows.append(time_fw(path, batch, args.new_tokens))
        rows.append(time_transformers(path, batch, args.new_tokens))
    report = {
        **report_header(f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"),
        "model": path.name,
        "results": rows,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    print(f"{path.name} on {report['device']}, {args.new_tokens} new tokens, greedy")
    print(f"{'engine':>22} {'batch':>6} {'decode tok/s':>13}")
    for row in rows:
        print(f"{row['engine']:>22} {row['batch']:>6} {row['decode_tokens_per_s']:>13.1f}")


if __name__ == "__main__":
    main()
