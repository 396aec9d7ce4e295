"""Pytest fixtures for fw and plugin tests: a plugin registered for one test, fresh plugin
loading, and one torch thread for a module of tiny-model tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from framework import plugins


@contextlib.contextmanager
def registered_plugin(obj: Any, name: str) -> Iterator[Any]:
    """Register ``obj`` as plugin ``name`` for the duration of the ``with`` block."""
    plugins.register_plugin(obj, name)
    try:
        yield obj
    finally:
        plugins.unregister_plugin(name)


@pytest.fixture(scope="module")
def one_thread():
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def register_fw_plugin():
    """Register plugin objects for one test: ``register_fw_plugin(obj, name="mine")``."""
    with contextlib.ExitStack() as stack:
        yield lambda obj, name="test_plugin": stack.enter_context(registered_plugin(obj, name))


@pytest.fixture
def fresh_plugins():
    """Reset plugin discovery before and after the test (environment changes take effect)."""
    plugins.reset_plugins()
    yield plugins
    plugins.reset_plugins()
