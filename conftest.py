"""Shared test set-up: Triton runs under its interpreter without CUDA; the ``gpu`` marker skips without CUDA."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton reads this when a kernel is decorated: set it before any plugin's kernels import,
    # so on CPU every Triton kernel runs under the interpreter (DESIGN §7).
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest_plugins = ["framework.testing"]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (gpu marker); run on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
