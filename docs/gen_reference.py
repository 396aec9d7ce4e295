"""Write the generated reference pages from the installed fw: the CLI's flag tables and the
supported-models/formats tables, read from the Typer app and the plugin registries.

    python docs/gen_reference.py            # rewrite docs/reference/cli.md and docs/models.md
    python docs/gen_reference.py --check    # exit 1 (naming the stale file) if either is out of date

``make docs`` runs it before ``mkdocs build --strict``; ``tests/docs/test_reference_pages.py``
checks that the committed pages name every flag and every registered architecture.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import typer.main

DOCS = Path(__file__).resolve().parent
CLI_PAGE = DOCS / "reference" / "cli.md"
MODELS_PAGE = DOCS / "models.md"
#: Commands documented, in this order (plugin commands follow).
COMMAND_ORDER = ("serve", "generate", "chat", "bench", "quantize", "version")


def _cell(text: object) -> str:
    """``text`` as one Markdown table cell (pipes escaped, one line)."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(param) -> str:
    default = param.default
    if default is None or param.param_type_name == "argument" and param.required:
        return ""
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, list | tuple):
        return ", ".join(map(str, default)) if default else ""
    return f"`{default}`" if str(default) != "" else ""


def command_flags(command) -> list[tuple[str, str, str]]:
    """``[(spelling, default, help)]`` of ``command``'s visible parameters: options by every
    spelling (``--m, --model``), arguments by name in capitals."""
    rows = []
    for param in command.params:
        if getattr(param, "hidden", False):
            continue
        if param.param_type_name == "argument":
            spelling = param.name.upper()
        else:
            spelling = ", ".join(f"`{opt}`" for opt in [*param.opts, *param.secondary_opts])
        rows.append((spelling, _default(param), _cell(getattr(param, "help", "") or "")))
    return rows


def _commands() -> list[tuple[str, object]]:
    from cli.main import build_app

    group = typer.main.get_command(build_app())
    names = [name for name in COMMAND_ORDER if name in group.commands]
    names += sorted(name for name in group.commands if name not in names and name != "plugins")
    found = [(name, group.commands[name]) for name in names]
    plugins = group.commands.get("plugins")
    if plugins is not None:
        found += [(f"plugins {name}", cmd) for name, cmd in sorted(plugins.commands.items())]
    return found


def cli_page() -> str:
    lines = [
        "# Command-line reference",
        "",
        "Every `fw` command and flag, generated from the installed CLI by `docs/gen_reference.py`",
        "(`make docs` rewrites this page; a test fails when it is stale). Engine flags are the same",
        "on `serve`, `generate` and `bench`, and are the fields of `EngineBuilder(...)` / `LLM(...)`.",
        "",
    ]
    for name, command in _commands():
        lines += [f"## fw {name}", "", _cell(command.help or ""), ""]
        rows = command_flags(command)
        if not rows:
            lines += ["No options.", ""]
            continue
        lines += ["| flag | default | what it does |", "| --- | --- | --- |"]
        lines += [f"| {spelling} | {default} | {text} |" for spelling, default, text in rows]
        lines.append("")
    return "\n".join(lines)


def _spec_table(registry, columns: list[tuple[str, object]]) -> list[str]:
    header = "| " + " | ".join(title for title, _ in columns) + " |"
    rows = [header, "| " + " | ".join("---" for _ in columns) + " |"]
    for spec in sorted(registry, key=lambda spec: spec.key):
        rows.append("| " + " | ".join(_cell(get(spec, registry)) for _, get in columns) + " |")
    return rows


def models_page() -> str:
    from framework import registries

    def plugin(spec, registry):
        return registry.plugin_of(spec.key)

    def devices(spec, _):
        return ", ".join(spec.devices)

    lines = [
        "# Supported models and formats",
        "",
        "Generated from the plugin registries of this install by `docs/gen_reference.py` (a test",
        "fails when a registered architecture is missing here). `fw plugins list` shows the same",
        "for the plugins you have installed, with what each needs.",
        "",
        "## Architectures",
        "",
        "The `architectures[0]` of a model's `config.json` (or the GGUF file's `general.architecture`)",
        "picks the implementation.",
        "",
    ]
    lines += _spec_table(
        registries.model_architectures(),
        [
            ("architecture", lambda spec, _: f"`{spec.name}`"),
            ("models", lambda spec, _: spec.description),
            ("KV cache", lambda spec, _: spec.kv_cache_layout),
            ("tensor parallel", lambda spec, _: "yes" if spec.supports_tensor_parallel else "no"),
            ("plugin", plugin),
        ],
    )
    sections = [
        ("Weight formats (`--load-format`)", registries.weight_formats()),
        ("Quantization methods (`--quantization`, or read from the checkpoint)", registries.quantization_methods()),
        ("Attention backends (`--attention-backend`)", registries.attention_backends()),
        ("KV-cache dtypes", registries.kv_cache_dtypes()),
        ("Tool-call parsers (`--tool-call-parser`)", registries.tool_parsers()),
        ("Reasoning parsers (`--reasoning-parser`)", registries.reasoning_parsers()),
    ]
    for title, registry in sections:
        lines += ["", f"## {title}", ""]
        lines += _spec_table(
            registry,
            [
                ("name", lambda spec, _: f"`{spec.name}`"),
                ("what it is", lambda spec, _: spec.description),
                ("devices", devices),
                ("plugin", plugin),
            ],
        )
    return "\n".join(lines) + "\n"


PAGES = {CLI_PAGE: cli_page, MODELS_PAGE: models_page}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report stale pages (exit 1)")
    args = parser.parse_args(argv)
    stale = []
    for path, build in PAGES.items():
        text = build()
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for path in stale:
        print(f"{path.relative_to(DOCS.parent)} is stale: run `make docs` (or python docs/gen_reference.py)")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
