"""lm-evaluation-harness against ``fw serve`` with only ``base_url`` and ``model``, and its
loglikelihoods against transformers on the same GGUF.

    pip install "lm_eval[api]"   # the `eval` extra of fw: not in the test extras (heavy)
    python benchmarks/lm_eval_local.py --out docs/benchmarks/DATE-cpu-lm-eval-smollm2.json

Starts ``fw serve`` on the embedded default model (CPU), runs two local tasks
(``benchmarks/lm_eval_tasks``: a multiple-choice task through ``local-completions`` and a generate
task through ``local-chat-completions``; no dataset download) with lm-eval's own defaults, then
scores every (context, continuation) pair lm-eval asked about with transformers
(``from_pretrained(gguf_file=...)``, fp32, its own GGUF tokenizer, lm-eval's context/continuation
split) and reports the largest absolute difference of the summed loglikelihoods. Run from the
repository root (the tasks name their data file relative to it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import report_header

from framework.distributed.config import free_port
from framework.loader.source import default_model_path

TASKS = Path(__file__).resolve().parent / "lm_eval_tasks"
MODEL = "SmolLM2-135M-Instruct.Q4_1"


def start_server(port: int, extra: list[str]) -> subprocess.Popen:
    """``fw serve`` on the default model; returns once it printed its ready line."""
    argv = [
        sys.executable,
        "-m",
        "cli.main",
        "serve",
        "--device",
        "cpu",
        "--max-model-len",
        "2048",
        "--mem",
        "64",
        "--h",
        f"127.0.0.1:{port}",
        *extra,
    ]
    process = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    for line in process.stdout:
        print(line, end="", flush=True)
        if line.startswith("fw: ready"):
            return process
    raise RuntimeError("fw serve exited before it was ready")


def run_task(model: str, base_url: str, task: str, **kwargs) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    started = time.perf_counter()
    results = lm_eval.simple_evaluate(
        model=model,
        model_args={"base_url": base_url, "model": MODEL},
        tasks=[task],
        task_manager=TaskManager(include_path=str(TASKS)),
        log_samples=True,
        **kwargs,
    )
    return {
        "results": results["results"][task],
        "samples": results["samples"][task],
        "seconds": time.perf_counter() - started,
    }


def transformers_loglikelihoods(pairs: list[tuple[str, str]]) -> list[tuple[float, bool]]:
    """(sum of continuation logprobs, is greedy) per pair, split as lm-eval's causal ``_encode_pair`` does."""
    import transformers

    path = default_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    scores = []
    for context, continuation in pairs:
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
        num_context = len(tokenizer(context, add_special_tokens=False)["input_ids"])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([whole])).logits[0].double(), -1)
        targets = torch.tensor(whole[num_context:])
        rows = logprobs[num_context - 1 : len(whole) - 1]
        scores.append(
            (rows[torch.arange(len(targets)), targets].sum().item(), bool((rows.argmax(-1) == targets).all()))
        )
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve-arg", action="append", default=[], help="an extra fw serve argument (repeatable)")
    parser.add_argument("--out", default=None, help="write the JSON report here")
    args = parser.parse_args()
    import lm_eval

    port = free_port()
    server = start_server(port, args.serve_arg)
    try:
        base = f"http://127.0.0.1:{port}"
        choice = run_task("local-completions", f"{base}/v1/completions", "fw_capitals_mc")
        generate = run_task(
            "local-chat-completions", f"{base}/v1/chat/completions", "fw_capitals_gen", apply_chat_template=True
        )
    finally:
        server.terminate()
        server.wait(60)
    pairs = [tuple(argument) for sample in choice["samples"] for argument in sample["arguments"]]
    served = [tuple(response[0]) for sample in choice["samples"] for response in sample["resps"]]
    reference = transformers_loglikelihoods(pairs)
    differences = [abs(fw[0] - ref[0]) for fw, ref in zip(served, reference, strict=True)]
    report = {
        **report_header("cpu"),
        "lm_eval": lm_eval.__version__ if hasattr(lm_eval, "__version__") else None,
        "model": MODEL,
        "serve_args": args.serve_arg,
        "model_args": "base_url and model only",
        "tasks": {
            "fw_capitals_mc": {
                "model": "local-completions",
                "metrics": choice["results"],
                "num_docs": len(choice["samples"]),
                "seconds": round(choice["seconds"], 1),
            },
            "fw_capitals_gen": {
                "model": "local-chat-completions",
                "metrics": generate["results"],
                "num_docs": len(generate["samples"]),
                "seconds": round(generate["seconds"], 1),
                "answers": [s["filtered_resps"][0] for s in generate["samples"]],
            },
        },
        "loglikelihood_vs_transformers": {
            "num_requests": len(pairs),
            "max_abs_diff": max(differences),
            "mean_abs_diff": sum(differences) / len(differences),
            "is_greedy_agreement": sum(fw[1] == ref[1] for fw, ref in zip(served, reference, strict=True)) / len(pairs),
        },
    }
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
