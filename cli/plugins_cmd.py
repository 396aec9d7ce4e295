"""``fw plugins list`` and ``fw plugins check``."""

from __future__ import annotations

import json
from typing import Annotated

import typer

app = typer.Typer(help="Inspect installed plugins.", no_args_is_help=True)


def _registrations() -> dict[str, dict[str, list[str]]]:
    """plugin name -> {registry kind: [keys]} over every register_* hook, without importing torch."""
    from framework import registries

    found: dict[str, dict[str, list[str]]] = {}
    for hook_name, (kind, _, _) in registries.REGISTRY_HOOKS.items():
        registry = registries.registry_for(hook_name)
        for spec in registry:
            found.setdefault(registry.plugin_of(spec.key), {}).setdefault(kind, []).append(spec.key)
    return found


@app.command("list")
def list_plugins(
    as_json: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")] = False,
) -> None:
    """List loaded plugins: name, version, distribution, hooks and what each registers."""
    from framework import plugins

    registered = _registrations()
    rows = [
        {
            "name": info.name,
            "version": info.version,
            "distribution": info.distribution,
            "module": info.module,
            "hooks": info.hooks,
            "registers": registered.get(info.name, {}),
        }
        for info in plugins.loaded_plugins()
    ]
    errors = [{"name": e.name, "distribution": e.distribution, "error": e.error} for e in plugins.load_errors()]
    if as_json:
        typer.echo(json.dumps({"plugins": rows, "errors": errors}, indent=2))
        return
    for row in rows:
        typer.echo(f"{row['name']} {row['version'] or ''} ({row['distribution'] or row['module']})".replace("  ", " "))
        typer.echo(f"  hooks: {', '.join(row['hooks'])}")
        for kind, keys in sorted(row["registers"].items()):
            typer.echo(f"  {kind}: {', '.join(keys)}")
    for error in errors:
        typer.echo(f"FAILED {error['error']}", err=True)


def _import_problem(spec) -> list[str]:
    """A spec that looks available but whose implementation fails to import is not available."""
    if not spec.impl:
        return []  # a declaration only (e.g. the KV-cache dtype "auto")
    try:
        spec.load()
    except Exception as exc:
        return [f"implementation {spec.impl} failed to import: {type(exc).__name__}: {exc}"]
    return []


@app.command("check")
def check_plugins(
    model: Annotated[
        str | None,
        typer.Option(
            "--m",
            help="Also say how tool calls are read for this model ('default': "
            "the embedded one; its chat template only, no weights).",
        ),
    ] = None,
    enforce_parser: Annotated[str | None, typer.Option("--enforce-parser", help="As fw serve's flag.")] = None,
) -> None:
    """Say which registered backends, methods and kernels can run on this machine, and why not."""
    from framework import registries
    from framework.platform import detect_platform

    if model is not None or enforce_parser is not None:
        typer.echo(f"tool calling: {_tool_calling(model, enforce_parser)}")

    platform = detect_platform()
    typer.echo(f"platform: {platform.describe()}")
    for hook_name, (kind, _, _) in registries.REGISTRY_HOOKS.items():
        registry = registries.registry_for(hook_name, platform)
        if not len(registry):
            continue
        typer.echo(f"{kind}s:")
        unavailable = registry.unavailable(platform)
        for spec in registry:
            reasons = unavailable.get(spec.key) or _import_problem(spec)
            status = "ok" if not reasons else "unavailable: " + "; ".join(reasons)
            typer.echo(f"  {spec.key} [{registry.plugin_of(spec.key)}] {status}{_kv_layouts(spec)}")


def _kv_layouts(spec) -> str:
    """The KV-cache layouts a backend reads or a model needs, which decide their pairing."""
    if hasattr(spec, "kv_cache_layouts"):
        return f" (KV layouts: {', '.join(spec.kv_cache_layouts)})"
    layout = getattr(spec, "kv_cache_layout", "standard")
    return "" if layout == "standard" else f" (KV layout: {layout})"


def _tool_calling(model: str | None, enforce_parser: str | None) -> str:
    """The tool-calling path ``fw serve`` would take for ``model`` (the default model when None)."""
    from framework import plugins
    from framework.loader.model_loader import open_model_source
    from framework.loader.source import resolve_local_path
    from framework.server.chat_tools import resolve_parsers

    plugins.load_plugins()
    tokenizer = open_model_source(resolve_local_path(None if model == "default" else model)).tokenizer()
    served = resolve_parsers(
        enforce_parser,
        None,
        tokenizer.chat_template,
        lambda messages, tools: tokenizer.apply_chat_template(messages, tools=tools),
    )
    return served.describe()
