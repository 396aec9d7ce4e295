"""Shared test set-up: the ``gpu`` marker skips without CUDA; plugin state is reset per test."""

from __future__ import annotations

import pytest

pytest_plugins = ["framework.testing"]


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (gpu marker); run on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
