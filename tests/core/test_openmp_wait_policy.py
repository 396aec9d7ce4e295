"""``import framework`` makes OpenMP threads sleep between parallel regions (OMP_WAIT_POLICY=PASSIVE)
unless the user chose a policy or torch was imported first (then it cannot take effect)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PRINT_POLICY = "import os, {first}; print(os.environ.get('OMP_WAIT_POLICY', '-'))"


def _policy(first: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run(
        [sys.executable, "-c", PRINT_POLICY.format(first=first)],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


@pytest.mark.parametrize(
    ("first", "env", "expected"),
    [
        ("framework", {}, "PASSIVE"),
        ("framework", {"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE"),
        ("framework", {"GOMP_SPINCOUNT": "100000"}, "-"),
        ("torch, framework", {}, "-"),
    ],
)
def test_wait_policy_default(first, env, expected):
    assert _policy(first, **env) == expected
