"""The documentation stays true to the CLI and the registries: the generated reference pages
(docs/reference/cli.md, docs/models.md) are current and name every flag and every registered
architecture, and the README's flag tables name only flags that exist, one table per command."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import typer.main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def commands():
    from cli.main import build_app

    group = typer.main.get_command(build_app())
    return {name: command for name, command in group.commands.items() if name != "plugins"}


def _flags(command) -> set[str]:
    return {
        opt
        for param in command.params
        if param.param_type_name == "option" and not param.hidden
        for opt in (*param.opts, *param.secondary_opts)
    }


def _section(text: str, heading: str) -> str:
    start = text.index(heading) + len(heading)
    following = re.search(r"^#{2,3} ", text[start:], re.M)
    return text[start : start + following.start()] if following else text[start:]


def test_generated_pages_are_current(gen):
    stale = [path.name for path, build in gen.PAGES.items() if path.read_text() != build()]
    assert not stale, f"{stale} out of date: run `make docs` (python docs/gen_reference.py)"


def test_cli_page_has_every_flag_of_every_command(commands):
    page = (ROOT / "docs" / "reference" / "cli.md").read_text()
    for name, command in commands.items():
        section = _section(page, f"## fw {name}\n")
        missing = sorted(flag for flag in _flags(command) if f"`{flag}`" not in section)
        assert not missing, f"fw {name}: flags missing from docs/reference/cli.md: {missing}"


def test_models_page_has_every_registered_architecture():
    from framework import registries

    page = (ROOT / "docs" / "models.md").read_text()
    architectures = _section(page, "## Architectures\n")
    missing = [spec.name for spec in registries.model_architectures() if f"| `{spec.name}` |" not in architectures]
    assert not missing, f"architectures missing from docs/models.md: {missing}"
    assert len(registries.model_architectures()) >= 16


def test_readme_flag_tables_name_real_flags(commands):
    readme = (ROOT / "README.md").read_text()
    engine = _section(readme, "### Engine flags (`fw serve`, `fw generate`, `fw bench`)\n")
    for name in ("serve", "generate", "bench", "chat", "quantize"):
        table = _section(readme, f"### `fw {name}`\n")
        named = set(re.findall(r"`(-{1,2}[a-z][a-z0-9-]*)`", table.split("\n| --- |")[1]))
        assert named, f"README has no flag table for fw {name}"
        unknown = sorted(named - _flags(commands[name]))
        assert not unknown, f"README's fw {name} table names flags fw {name} does not have: {unknown}"
    for name in ("serve", "generate", "bench"):
        unknown = sorted(set(re.findall(r"`(-{1,2}[a-z][a-z0-9-]*)`", engine)) - _flags(commands[name]))
        assert not unknown, f"README's engine flags are not all flags of fw {name}: {unknown}"
