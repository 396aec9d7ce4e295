"""``fw version``."""

from __future__ import annotations

import typer

import framework


def version() -> None:
    from framework import plugins

    typer.echo(f"fw {framework.__version__}")
    for info in plugins.loaded_plugins():
        if info.name != plugins.CORE_PLUGIN:
            typer.echo(f"  {info.name} {info.version or '?'} ({info.distribution or info.module})")
