"""``fw serve`` life cycle: unix-socket bind, the queue cap (429), SIGTERM draining, load errors, bind parsing."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import stat
import subprocess
import sys

import httpx
import pytest

BODY = {"model": "tiny", "prompt": "t5 t9 t12", "max_tokens": 48, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def unix_server(tiny_model_dir, launch_fw_server, tmp_path_factory):
    sock = tmp_path_factory.mktemp("sock") / "fw.sock"
    proc = launch_fw_server(
        [
            "--m",
            str(tiny_model_dir),
            "--device",
            "cpu",
            "--h",
            f"unix://{sock}",
            "--served-model-name",
            "tiny",
            "--max-num-seqs",
            "2",
            "--max-queued-requests",
            "2",
            "--shutdown-timeout",
            "60",
            "--max-gen-tokens",
            "5",
        ],
        f"unix://{sock}",
    )
    proc.socket_path = str(sock)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def _client(server) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.AsyncHTTPTransport(uds=server.socket_path), base_url="http://fw", timeout=120
    )


def test_unix_socket_bind_serves_requests(unix_server):
    assert any(
        f"unix://{unix_server.socket_path}" in line for line in unix_server.lines if line.startswith("fw: ready")
    )

    async def main():
        async with _client(unix_server) as c:
            assert (await c.get("/health")).status_code == 200
            return (await c.post("/v1/completions", json={**BODY, "max_tokens": 3})).json()

    assert asyncio.run(main())["usage"]["completion_tokens"] == 3


def test_unix_socket_is_created_with_mode_0600(unix_server):
    mode = os.stat(unix_server.socket_path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600, oct(mode)


def test_max_gen_tokens_is_the_default_max_tokens(unix_server):
    async def main():
        async with _client(unix_server) as c:
            chat = await c.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "t5"}], "ignore_eos": True}
            )
            completion = await c.post("/v1/completions", json={"prompt": "t5", "ignore_eos": True})
            return chat.json(), completion.json()

    chat, completion = asyncio.run(main())
    assert chat["usage"]["completion_tokens"] == 5 and completion["usage"]["completion_tokens"] == 5


def test_queue_cap_answers_429_while_admitted_requests_complete(unix_server):
    async def main():
        async with _client(unix_server) as c:
            return await asyncio.gather(*[c.post("/v1/completions", json=BODY) for _ in range(10)])

    responses = asyncio.run(main())
    admitted = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(admitted) + len(refused) == 10
    assert 1 <= len(admitted) <= 4 and refused  # 2 running + 2 queued at most
    assert all(r.json()["usage"]["completion_tokens"] == 48 for r in admitted)
    assert all(r.headers["Retry-After"] == "1" and r.json()["error"]["code"] == "too_many_requests" for r in refused)


def test_disconnects_abort_queued_and_running_requests(unix_server):
    def values(text):
        return [
            float(re.search(rf"^{name}{{[^}}]*}} (\S+)$", text, re.MULTILINE).group(1))
            for name in (
                "fw:num_requests_running",
                "fw:num_requests_waiting",
                "fw:num_kv_blocks_used",
                "fw:generation_tokens_total",
            )
        ]

    async def main():
        async with _client(unix_server) as c:
            before = values((await c.get("/metrics")).text)
            tasks = [asyncio.create_task(c.post("/v1/completions", json={**BODY, "max_tokens": 240})) for _ in range(4)]
            for _ in range(200):  # until 2 run and 2 wait in the engine
                seen = values((await c.get("/metrics")).text)
                if seen[:2] == [2, 2]:
                    break
                await asyncio.sleep(0.02)
            for task in tasks:
                task.cancel()  # closes the connections mid-request
            await asyncio.gather(*tasks, return_exceptions=True)
            for _ in range(100):
                after = values((await c.get("/metrics")).text)
                if after[:3] == [0, 0, 0]:
                    break
                await asyncio.sleep(0.05)
            return seen, after[:3], after[3] - before[3]

    seen, after, generated = asyncio.run(main())
    assert seen[:2] == [2, 2]
    assert after == [0, 0, 0]
    assert generated < 2 * 240


def test_sigterm_finishes_in_flight_requests_then_exits(unix_server):
    async def stream(c, started: asyncio.Event):
        text, reason = "", None
        async with c.stream("POST", "/v1/completions", json={**BODY, "max_tokens": 120, "stream": True}) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    started.set()
                    if '"finish_reason":"' in line:
                        reason = line.split('"finish_reason":"')[1].split('"')[0]
                text += line
        return reason, text.endswith("data: [DONE]")

    async def main():
        async with _client(unix_server) as c:
            events = [asyncio.Event(), asyncio.Event()]
            tasks = [asyncio.create_task(stream(c, e)) for e in events]
            for event in events:
                await event.wait()
            unix_server.process.send_signal(signal.SIGTERM)
            return await asyncio.gather(*tasks)

    assert asyncio.run(main()) == [("length", True), ("length", True)]
    assert unix_server.process.wait(60) == 0


def test_load_error_is_shown_and_exits_non_zero(launch_fw_server, free_tcp_port, tmp_path):
    missing = tmp_path / "no-model-here"
    proc = launch_fw_server(["--m", str(missing), "--device", "cpu", "--p", str(free_tcp_port())], "")
    try:
        code = proc.process.wait(120)
    finally:
        proc.stop()
    proc_output = "\n".join(proc.lines)
    assert code == 1, proc_output
    assert "could not load the model" in proc_output and "no-model-here" in proc_output


def _serve_runner(monkeypatch):
    """``(runner, app, calls)``: ``fw serve`` as a Typer app whose ``run_server`` records its arguments."""
    from typer import Typer
    from typer.testing import CliRunner

    from cli import serve_cmd
    from framework.server import launcher

    calls = []
    monkeypatch.setattr(launcher, "run_server", lambda *args, **kwargs: calls.append((args, kwargs)) or 0)
    app = Typer()
    app.command("serve")(serve_cmd.serve)
    app.command("other")(lambda: None)
    return CliRunner(), app, calls


def test_serve_options_reach_the_engine_and_the_server(monkeypatch):
    runner, app, calls = _serve_runner(monkeypatch)
    result = runner.invoke(
        app,
        [
            "serve",
            "--h",
            "[::1]:9000",
            "--disable-prefix-cache",
            "--disable-cuda-graph",
            "--api-key",
            "a",
            "--api-key",
            "b",
            "--max-gen-tokens",
            "7",
            "--num-blocks",
            "64",
        ],
    )
    assert result.exit_code == 0, result.output
    (engine_kwargs, config, bind), kwargs = calls[0]
    assert engine_kwargs["model"] is None  # no --m: the embedded default model
    assert config.served_model_names == ["SmolLM2-135M-Instruct.Q4_1"]
    assert engine_kwargs["enable_prefix_caching"] is False and engine_kwargs["enable_cuda_graphs"] is False
    assert engine_kwargs["num_blocks"] == 64 and config.api_keys == ["a", "b"] and config.max_gen_tokens == 7
    assert tuple(bind) == ("::1", 9000, None) and kwargs["shutdown_timeout"] == 30.0
    bad = runner.invoke(app, ["serve", "--h", "127.0.0.1:http"])
    assert bad.exit_code == 2 and "port" in bad.output


def test_serve_request_limits_reach_the_server_and_are_checked(monkeypatch):
    runner, app, calls = _serve_runner(monkeypatch)
    result = runner.invoke(app, ["serve"])
    assert result.exit_code == 0, result.output
    (_, config, _), kwargs = calls[-1]
    assert (config.max_n, config.max_prompts, config.max_embedding_inputs) == (128, 128, 256)
    assert (config.max_queued_requests, config.max_queued_tokens) == (1024, 1 << 20)  # finite by default
    assert config.request_body_timeout_s == 30.0 and kwargs["limit_concurrency"] == 1024
    result = runner.invoke(
        app,
        [
            "serve",
            "--max-n",
            "4",
            "--max-prompts",
            "2",
            "--max-embedding-inputs",
            "3",
            "--request-body-timeout",
            "5",
            "--limit-concurrency",
            "10",
            "--max-queued-requests",
            "0",
            "--max-queued-tokens",
            "100",
        ],
    )
    assert result.exit_code == 0, result.output
    (_, config, _), kwargs = calls[-1]
    assert (config.max_n, config.max_prompts, config.max_embedding_inputs) == (4, 2, 3)
    assert (config.max_queued_requests, config.max_queued_tokens) == (0, 100)
    assert config.request_body_timeout_s == 5.0 and kwargs["limit_concurrency"] == 10
    for flag, value in (
        ("--max-n", "0"),
        ("--limit-concurrency", "0"),
        ("--request-body-timeout", "0"),
        ("--max-queued-tokens", "0"),
    ):
        bad = runner.invoke(app, ["serve", flag, value])
        assert bad.exit_code != 0 and flag in bad.output, (flag, bad.output)


def test_serve_module_does_not_import_torch():
    code = "import sys, cli.serve_cmd; assert 'torch' not in sys.modules and 'litestar' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        (None, ("127.0.0.1", 2000, None)),
        ("0.0.0.0", ("0.0.0.0", 2000, None)),
        ("127.0.0.1", ("127.0.0.1", 2000, None)),
        ("127.0.0.1:8000", ("127.0.0.1", 8000, None)),
        ("[::1]:8000", ("::1", 8000, None)),
        ("::1", ("::1", 2000, None)),
        ("tcp://localhost:9000", ("localhost", 9000, None)),
        ("unix:///tmp/fw.sock", (None, None, "/tmp/fw.sock")),
        ("socket:///tmp/a.sock", (None, None, "/tmp/a.sock")),
    ],
)
def test_bind_address_forms(address, expected):
    from framework.server.launcher import parse_bind

    assert tuple(parse_bind(address, 2000)) == expected


def test_bad_bind_address_names_the_problem():
    from framework.errors import ConfigError
    from framework.server.launcher import parse_bind

    with pytest.raises(ConfigError, match="port"):
        parse_bind("127.0.0.1:http", 2000)
    assert parse_bind("[::1]:8000", 2000).url == "http://[::1]:8000"
