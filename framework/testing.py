"""Test helpers for fw and for plugin authors (a pytest plugin: ``pytest_plugins = ["framework.testing"]``).

Fixtures:

* ``register_fw_plugin``: ``register_fw_plugin(obj, name="x")`` registers a plugin object (a
  module or any object with ``@hookimpl`` methods) for the current test only.
* ``fresh_plugins``: forget loaded plugins before and after the test, so a test can set
  ``FW_PLUGINS`` / ``FW_DISABLE_PLUGINS`` with ``monkeypatch`` and load again.
"""

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
