"""Serving benchmark for any OpenAI-compatible server (fw, vLLM, llama.cpp, ...).

Sends random prompts over streaming ``/v1/completions`` (or ``/v1/chat/completions``) at each
concurrency of a sweep and reports time to first token, inter-token latency, end-to-end latency
and throughput, as a table on stderr and JSON on stdout (or ``--out``)::

    python benchmarks/serving.py --base-url http://127.0.0.1:2000 --concurrency 1,4,16 \\
        --num-prompts 64 --input-len 128 --output-len 64 --out result.json

Prompts are random words (``--prompt-kind words``, works everywhere) or random token ids
(``--prompt-kind ids --vocab-size N``, exact prompt lengths, completions endpoint only).
``ignore_eos`` is sent so every request generates ``--output-len`` tokens (a vLLM/fw extension;
``--no-ignore-eos`` for servers that reject it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

import httpx

WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue side "
    "kind head house service friend father power hour game line end member law car city community name"
).split()


@dataclass(slots=True)
class RequestResult:
    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None


def make_prompts(args: argparse.Namespace, rng: random.Random) -> list[str | list[int]]:
    if args.prompt_kind == "ids":
        return [[rng.randrange(args.vocab_size) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    return [" ".join(rng.choice(WORDS) for _ in range(args.input_len)) for _ in range(args.num_prompts)]


def request_body(args: argparse.Namespace, model: str, prompt: str | list[int]) -> tuple[str, dict]:
    body: dict = {
        "model": model,
        "max_tokens": args.output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if not args.no_ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**body, "prompt": prompt}


async def one_request(client: httpx.AsyncClient, path: str, body: dict) -> RequestResult:
    start = time.perf_counter()
    result = RequestResult(ok=False)
    last = None
    chunks = 0
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = str(event["error"])
                    return result
                if event.get("usage"):
                    result.output_tokens = event["usage"].get("completion_tokens", 0)
                for choice in event.get("choices", []):
                    text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    if not text:
                        continue
                    now = time.perf_counter()
                    if last is None:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
                    chunks += 1
    except httpx.HTTPError as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.e2e_s = time.perf_counter() - start
    result.output_tokens = result.output_tokens or chunks
    result.ok = last is not None
    if not result.ok:
        result.error = "no tokens received"
    return result


def summarize(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]

    return {"mean": statistics.fmean(values), "p50": pct(50), "p90": pct(90), "p99": pct(99), "max": ordered[-1]}


async def run_level(
    client: httpx.AsyncClient, args: argparse.Namespace, model: str, prompts: list, concurrency: int
) -> dict:
    semaphore = asyncio.Semaphore(concurrency)

    async def limited(prompt):
        async with semaphore:
            return await one_request(client, *request_body(args, model, prompt))

    start = time.perf_counter()
    results = await asyncio.gather(*[limited(p) for p in prompts])
    duration = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "concurrency": concurrency,
        "num_requests": len(results),
        "num_ok": len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "request_throughput_per_s": len(ok) / duration,
        "output_throughput_tok_per_s": output_tokens / duration,
        "total_output_tokens": output_tokens,
        "ttft_s": summarize([r.ttft_s for r in ok]),
        "itl_s": summarize([x for r in ok for x in r.itl_s]),
        "tpot_s": summarize([(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]),
        "e2e_s": summarize([r.e2e_s for r in ok]),
    }


async def main_async(args: argparse.Namespace) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(args.concurrency) + 4, max_keepalive_connections=max(args.concurrency))
    async with httpx.AsyncClient(
        base_url=args.base_url.rstrip("/"), headers=headers, timeout=args.timeout, limits=limits
    ) as client:
        model = args.model
        if model is None:
            model = (await client.get("/v1/models")).raise_for_status().json()["data"][0]["id"]
        rng = random.Random(args.seed)
        levels = []
        for concurrency in args.concurrency:
            if args.warmup:
                await run_level(
                    client, args, model, make_prompts(args, rng)[: min(concurrency, args.warmup)], concurrency
                )
            level = await run_level(client, args, model, make_prompts(args, rng), concurrency)
            levels.append(level)
            print(_row(level), file=sys.stderr, flush=True)
    config = {k: v for k, v in vars(args).items() if k not in ("api_key", "out")}
    return {"model": model, "config": config, "results": levels}


def _row(level: dict) -> str:
    def ms(d: dict, key: str) -> str:
        return f"{d[key] * 1000:8.1f}" if d else "       -"

    return (
        f"concurrency {level['concurrency']:4d} | ok {level['num_ok']}/{level['num_requests']} | "
        f"{level['output_throughput_tok_per_s']:8.1f} tok/s | {level['request_throughput_per_s']:6.2f} req/s | "
        f"TTFT p50 {ms(level['ttft_s'], 'p50')} ms p99 {ms(level['ttft_s'], 'p99')} ms | "
        f"ITL p50 {ms(level['itl_s'], 'p50')} ms p99 {ms(level['itl_s'], 'p99')} ms"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:2000", help="server root (without /v1)")
    parser.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    parser.add_argument(
        "--concurrency",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 4, 16],
        help="comma-separated concurrency levels to sweep",
    )
    parser.add_argument("--num-prompts", type=int, default=64, help="requests per concurrency level")
    parser.add_argument("--input-len", type=int, default=128, help="prompt length in words or token ids")
    parser.add_argument("--output-len", type=int, default=64, help="max_tokens of every request")
    parser.add_argument("--prompt-kind", choices=("words", "ids"), default="words")
    parser.add_argument("--vocab-size", type=int, default=32000, help="token ids are drawn from [0, vocab-size)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up requests before each level (0 = none)")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the JSON here instead of stdout")
    args = parser.parse_args(argv)
    if args.prompt_kind == "ids" and args.endpoint == "chat":
        parser.error("--prompt-kind ids needs --endpoint completions")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = asyncio.run(main_async(args))
    text = json.dumps(report, indent=2)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")
    else:
        print(text)
    return 0 if all(level["num_ok"] == level["num_requests"] for level in report["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
