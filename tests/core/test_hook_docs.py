"""Every hook is documented in docs/plugin-hooks.md and exercised by at least one test."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from framework import hookspecs, plugins

ROOT = Path(__file__).resolve().parents[2]


def test_every_hook_is_documented_with_its_signature():
    doc = (ROOT / "docs" / "plugin-hooks.md").read_text()
    missing = []
    for name in plugins.hook_names():
        params = ", ".join(inspect.signature(getattr(hookspecs, name)).parameters)
        if f"### `{name}({params})`" not in doc:
            missing.append(f"{name}({params})")
    assert not missing, f"docs/plugin-hooks.md lacks a '### `hook(args)`' heading for: {missing}"


def test_every_hook_is_named_in_a_test():
    sources = "\n".join(
        p.read_text()
        for p in [*ROOT.glob("tests/**/*.py"), *ROOT.glob("plugins/*/*/tests/*.py")]
        if p.name != Path(__file__).name
    )
    untested = [name for name in plugins.hook_names() if not re.search(rf"\b{name}\b", sources)]
    assert not untested, f"hooks no test exercises: {untested}"
