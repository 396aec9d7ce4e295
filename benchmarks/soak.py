"""Soak test of ``fw serve``: many streaming clients for a long time, with random disconnects.

Starts ``fw serve`` on the embedded default model on a free loopback port (or targets a running
server on loopback with ``--base-url``), runs ``--clients`` concurrent streaming clients (chat and
completions, random lengths; a share of them hang up mid-stream) for ``--duration`` seconds, then
stops by itself and reports::

    errors by kind (only 429 is acceptable), requests completed and disconnected, tokens/s,
    the API and engine processes' RSS over time (flat), KV blocks in use at the end (0, /metrics)

as a table on stderr and JSON (``--out``, else stdout) that starts with :func:`common.report_header`::

    python benchmarks/soak.py --clients 64 --duration 600 --out docs/benchmarks/soak.json
    python benchmarks/soak.py --base-url http://127.0.0.1:2000 --pid 12345 --clients 16 --duration 45

The exit code is 1 when the run failed one of those checks. Traffic goes only to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlparse

import httpx
from common import report_header

from framework.distributed.config import free_port

REPO = Path(__file__).resolve().parents[1]
LOOPBACK = ("127.0.0.1", "localhost", "::1")
WORDS = (
    "river stone cloud garden lamp winter bread music paper window forest letter engine harbor candle "
    "mountain silver orange question story market bridge season morning island"
).split()
ALLOWED_ERRORS = {"http_429"}


class Server:
    """``fw serve`` started here on a loopback port; ``stop()`` sends SIGTERM."""

    def __init__(self, serve_args: list[str], ready_timeout_s: float) -> None:
        port = free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        self.command = [sys.executable, "-m", "cli.main", "serve", "--h", f"127.0.0.1:{port}", *serve_args]
        self.process = subprocess.Popen(
            self.command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: queue.Queue = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        deadline = time.monotonic() + ready_timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                line = ""
            if line is None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit("fw serve did not get ready:\n" + "\n".join(self.log[-30:]))
            if line.startswith("fw: ready"):
                return

    def _pump(self) -> None:
        for line in self.process.stdout:
            self.log.append(line.rstrip("\n"))
            self.lines.put(line)
        self.lines.put(None)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def rss_mb(pid: int | None) -> float | None:
    """Resident memory of ``pid`` in MiB (from /proc), None if unknown or gone."""
    if pid is None:
        return None
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
    return int(match.group(1)) / 1024 if match else None


def engine_pid(api_pid: int | None) -> int | None:
    """The API process's child (the engine process; a restarted engine is a new child)."""
    if api_pid is None:
        return None
    try:
        children = Path(f"/proc/{api_pid}/task/{api_pid}/children").read_text().split()
    except OSError:
        return None
    return int(children[0]) if children else None


def metric(text: str, name: str) -> float | None:
    match = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else None


class Soak:
    def __init__(self, args: argparse.Namespace, base_url: str, api_pid: int | None) -> None:
        self.args, self.base_url, self.api_pid = args, base_url, api_pid
        self.errors: Counter[str] = Counter()
        self.error_examples: dict[str, str] = {}
        self.completed = self.disconnected = self.cut_off = self.tokens = 0
        self.samples: list[dict] = []

    def error(self, kind: str, detail: str) -> None:
        self.errors[kind] += 1
        self.error_examples.setdefault(kind, detail[:300])

    def body(self, rng: random.Random) -> tuple[str, dict]:
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, self.args.max_prompt_words)))
        body = {
            "max_tokens": rng.randint(8, self.args.max_tokens),
            "stream": True,
            "temperature": rng.choice([0.0, 0.7]),
            "ignore_eos": rng.random() < 0.5,
            "stream_options": {"include_usage": True},
        }
        if rng.random() < 0.5:
            return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": f"Tell me about {text}."}]}
        return "/v1/completions", {**body, "prompt": text}

    async def one_request(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        path, body = self.body(rng)
        hang_up_after = rng.randint(1, 8) if rng.random() < self.args.disconnect_fraction else None
        events = 0
        try:
            async with http.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    self.error(f"http_{response.status_code}", (await response.aread()).decode(errors="replace"))
                    if response.status_code == 429:
                        await asyncio.sleep(rng.uniform(0.1, 0.5))
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: ") :]
                    if data == "[DONE]":
                        self.completed += 1
                        return
                    event = json.loads(data)
                    if "error" in event:
                        self.error(f"stream_{event['error'].get('code')}", event["error"].get("message", ""))
                        return
                    if event.get("usage"):
                        self.tokens += event["usage"]["completion_tokens"]
                    events += 1
                    if hang_up_after is not None and events >= hang_up_after:
                        self.disconnected += 1
                        self.tokens += events  # about one token per event
                        return  # leaving the block closes the connection mid-stream
            self.error("stream_without_done", path)
        except httpx.HTTPError as error:
            self.error(type(error).__name__, str(error))
        except asyncio.CancelledError:
            self.cut_off += 1  # still streaming when the run ended
            raise

    async def client(self, index: int, deadline: float) -> None:
        rng = random.Random(self.args.seed * 1000 + index)
        async with httpx.AsyncClient(base_url=self.base_url, timeout=self.args.request_timeout) as http:
            while time.monotonic() < deadline:
                await self.one_request(http, rng)

    async def sample(self, http: httpx.AsyncClient, started: float) -> dict:
        sample = {
            "t_s": round(time.monotonic() - started, 1),
            "api_rss_mb": rss_mb(self.api_pid),
            "engine_rss_mb": rss_mb(engine_pid(self.api_pid)),
        }
        try:
            text = (await http.get("/metrics", timeout=10)).text
            sample.update(
                kv_blocks_used=metric(text, "fw:num_kv_blocks_used"),
                running=metric(text, "fw:num_requests_running"),
                waiting=metric(text, "fw:num_requests_waiting"),
                engine_restarts=metric(text, "fw:engine_restarts_total"),
            )
        except httpx.HTTPError as error:
            self.error(f"metrics_{type(error).__name__}", str(error))
        return sample

    async def run(self) -> dict:
        started = time.monotonic()
        deadline = started + self.args.duration
        clients = [asyncio.create_task(self.client(i, deadline)) for i in range(self.args.clients)]
        async with httpx.AsyncClient(base_url=self.base_url) as http:
            while time.monotonic() < deadline:
                self.samples.append(await self.sample(http, started))
                await asyncio.sleep(min(self.args.sample_interval, max(0.0, deadline - time.monotonic())))
            for task in clients:  # requests still streaming are cut off: more disconnects
                task.cancel()
            await asyncio.gather(*clients, return_exceptions=True)
            elapsed = time.monotonic() - started
            settle = time.monotonic() + 30
            final = await self.sample(http, started)
            while final.get("kv_blocks_used") != 0 and time.monotonic() < settle:
                await asyncio.sleep(0.5)
                final = await self.sample(http, started)
            self.samples.append(final)
            try:
                health = (await http.get("/health", timeout=10)).json()
            except (httpx.HTTPError, ValueError) as error:
                health = {"status": f"unreachable: {type(error).__name__}"}
        return self.report(elapsed, final, health)

    def report(self, elapsed: float, final: dict, health: dict) -> dict:
        def growth(key: str) -> float | None:
            values = [s[key] for s in self.samples if s.get(key) is not None]
            warm = values[len(values) // 10 :]  # leave out the warm-up (allocator pools, compiled kernels)
            return round(warm[-1] - warm[0], 1) if len(warm) >= 2 else None

        unexpected = {kind: n for kind, n in self.errors.items() if kind not in ALLOWED_ERRORS}
        results = {
            "elapsed_s": round(elapsed, 1),
            "requests_completed": self.completed,
            "requests_disconnected": self.disconnected,
            "requests_cut_off_at_end": self.cut_off,
            "output_tokens": self.tokens,
            "tokens_per_s": round(self.tokens / elapsed, 1),
            "errors": dict(self.errors),
            "error_examples": self.error_examples,
            "kv_blocks_used_end": final.get("kv_blocks_used"),
            "api_rss_growth_mb": growth("api_rss_mb"),
            "engine_rss_growth_mb": growth("engine_rss_mb"),
            "health_end": health,
            "samples": self.samples,
        }
        results["ok"] = not unexpected and final.get("kv_blocks_used") == 0 and health.get("status") == "ok"
        return results


def print_table(results: dict) -> None:
    rows = [
        ("elapsed", f"{results['elapsed_s']} s"),
        ("completed", results["requests_completed"]),
        ("disconnected", results["requests_disconnected"]),
        ("cut off at the end", results["requests_cut_off_at_end"]),
        ("tokens/s", results["tokens_per_s"]),
        ("errors", ", ".join(f"{k}: {v}" for k, v in results["errors"].items()) or "none"),
        ("KV blocks used at end", results["kv_blocks_used_end"]),
        ("API RSS growth", f"{results['api_rss_growth_mb']} MiB"),
        ("engine RSS growth", f"{results['engine_rss_growth_mb']} MiB"),
        ("health at end", results["health_end"].get("status")),
        ("verdict", "ok" if results["ok"] else "FAILED"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}", file=sys.stderr)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of traffic")
    parser.add_argument("--disconnect-fraction", type=float, default=0.2, help="share of requests cut off mid-stream")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-prompt-words", type=int, default=64)
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--sample-interval", type=float, default=5.0, help="seconds between RSS / metrics samples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--base-url", default=None, help="a running server on loopback (default: start fw serve)")
    parser.add_argument("--pid", type=int, default=None, help="with --base-url: the API process, for RSS")
    parser.add_argument("--device", default=None, help="fw serve --device (default: the GPU if there is one)")
    parser.add_argument("--serve-args", default="", help="more fw serve flags, one shell-quoted string")
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.base_url is not None and urlparse(args.base_url).hostname not in LOOPBACK:
        parser.error(f"--base-url must be a loopback address ({', '.join(LOOPBACK)}), got {args.base_url}")
    if args.clients < 1 or args.duration <= 0:
        parser.error("--clients must be >= 1 and --duration > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    import shlex

    args = parse_args(argv)
    server = None
    if args.base_url is None:
        serve_args = (["--device", args.device] if args.device else []) + shlex.split(args.serve_args)
        server = Server(serve_args, args.ready_timeout)
        base_url, api_pid = server.base_url, server.process.pid
    else:
        base_url, api_pid = args.base_url.rstrip("/"), args.pid
    try:
        results = asyncio.run(Soak(args, base_url, api_pid).run())
    finally:
        if server is not None:
            server.stop()
    report = {
        **report_header(device=args.device if args.device == "cpu" else None),
        "server_command": shlex.join(["fw", *server.command[3:]]) if server else None,
        "clients": args.clients,
        "duration_s": args.duration,
        "disconnect_fraction": args.disconnect_fraction,
        "max_tokens": args.max_tokens,
        **results,
    }
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        print(text)
    print_table(results)
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
