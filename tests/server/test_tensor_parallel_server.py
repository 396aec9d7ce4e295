"""``fw serve`` with tensor parallelism on CPU (gloo): two "nodes" on loopback, and a worker killed mid-generation.

Node 0 serves HTTP; node 1 (``--node-rank 1``) only runs its worker. Their ids equal transformers'.
A killed worker fails the in-flight stream with an error, ``/health`` turns 503, and no process
of the group is left behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import tokenizers
import torch

from framework.testing import reference_greedy

REPO = Path(__file__).resolve().parents[2]
PROMPT_IDS = [5, 9, 33, 2, 71, 40]


def worker_pids(master_port: int) -> list[int]:
    """Processes of ``framework.engine.tp_worker`` that joined the rendezvous on ``master_port``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"framework.engine.tp_worker" in argv and f"--master=127.0.0.1:{master_port}".encode() in argv:
            pids.append(int(entry.name))
    return pids


def is_running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def assert_serves_the_ids_of_transformers(server, model_dir: Path, reference) -> None:
    """10 greedy tokens of ``PROMPT_IDS`` from the served model ``tiny`` equal ``reference``'s (transformers)."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    completion = client.completions.create(
        model="tiny", prompt=PROMPT_IDS, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    expected = reference_greedy(reference, PROMPT_IDS, 10)
    tokenizer = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert completion.choices[0].text.split() == tokenizer.decode(expected).split()
    assert completion.usage.completion_tokens == 10


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return model.eval()


def test_two_nodes_on_loopback_serve_the_ids_of_transformers(
    tiny_model_dir, serve_on_free_port, free_tcp_port, reference
):
    master_port = free_tcp_port()
    common = [
        "--m",
        str(tiny_model_dir),
        "--device",
        "cpu",
        "--tp",
        "2",
        "--num-nodes",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(master_port),
        "--rendezvous-timeout",
        "120",
    ]
    node1 = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "serve", *common, "--node-rank", "1"],
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        with serve_on_free_port([*common, "--node-rank", "0", "--served-model-name", "tiny"]) as server:
            assert any("tensor parallel 2, 2 node(s)" in line for line in server.lines)
            assert_serves_the_ids_of_transformers(server, tiny_model_dir, reference)
    finally:
        try:
            node1.wait(30)  # rank 0's shutdown ends node 1's worker, and node 1 with it
        finally:
            if node1.poll() is None:
                node1.kill()
    assert node1.returncode == 0, node1.stdout.read()
    assert worker_pids(master_port) == []


def test_killed_worker_fails_the_stream_turns_health_503_and_leaves_no_process(
    tiny_model_dir, serve_on_free_port, free_tcp_port
):
    master_port = free_tcp_port()
    with serve_on_free_port(
        [
            "--m",
            str(tiny_model_dir),
            "--device",
            "cpu",
            "--tp",
            "2",
            "--master-port",
            str(master_port),
            "--served-model-name",
            "tiny",
        ]
    ) as server:
        engine_pid = server.engine_pid
        [worker] = worker_pids(master_port)
        assert httpx.get(f"{server.base_url}/health").status_code == 200
        body = {
            "model": "tiny",
            "prompt": "t5 t9",
            "max_tokens": 200,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        events = []
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line)
                if len(events) == 3:
                    os.kill(worker, signal.SIGKILL)
        assert events[-1] == "data: [DONE]"
        errors = [event for event in events if '"error"' in event]
        assert errors and "tensor-parallel worker rank 1" in errors[0] and "SIGKILL" in errors[0], events[-3:]
        assert len(events) < 150  # it stopped soon after the kill
        health = httpx.get(f"{server.base_url}/health")
        assert health.status_code == 503 and "tensor-parallel worker rank 1" in health.json()["message"]
        wait_until(lambda: not is_running(engine_pid), 30, "the engine process to exit")
        retry = httpx.post(f"{server.base_url}/v1/completions", json={**body, "stream": False})
        assert retry.status_code == 503
    assert server.process.returncode is not None
    assert worker_pids(master_port) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_serve_on_two_gpus_gives_the_ids_of_transformers(tiny_model_dir, serve_on_free_port, reference):
    with serve_on_free_port(
        ["--m", str(tiny_model_dir), "--d", "0,1", "--dtype", "f32", "--served-model-name", "tiny"]
    ) as server:
        assert any("tensor parallel 2" in line for line in server.lines)
        assert_serves_the_ids_of_transformers(server, tiny_model_dir, reference)
