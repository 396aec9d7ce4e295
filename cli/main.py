"""The ``fw`` Typer app: built-in commands plus those plugins add through ``register_commands``.

Importing this module must stay cheap (``fw --help`` does not import torch): commands import
their heavy dependencies inside their functions.
"""

from __future__ import annotations

import typer

from cli import plugins_cmd, version_cmd


def build_app() -> typer.Typer:
    """Create the app, load plugins and let them add commands."""
    from framework import plugins

    app = typer.Typer(
        name="fw",
        help="fw: serve and run local LLMs fast, with an OpenAI-compatible API and plugins.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )
    app.command("version", help="Print the fw version and the installed plugin versions.")(version_cmd.version)
    app.add_typer(plugins_cmd.app, name="plugins")
    for name, command in _builtin_commands().items():
        app.command(name, **command.get("kwargs", {}))(command["function"])
    plugins.call_all("register_commands", app=app)
    return app


def _builtin_commands() -> dict:
    """Engine commands; their modules import torch only when run."""
    from cli import bench_cmd, chat_cmd, generate_cmd, serve_cmd

    return {
        "serve": {"function": serve_cmd.serve, "kwargs": {"help": "Serve a model with an OpenAI-compatible API."}},
        "generate": {"function": generate_cmd.generate, "kwargs": {"help": "Generate text for one prompt."}},
        "chat": {"function": chat_cmd.chat, "kwargs": {"help": "Chat with a running fw serve (streaming REPL)."}},
        "bench": {"function": bench_cmd.bench, "kwargs": {"help": "Offline throughput benchmark with random prompts."}},
    }


def main() -> None:
    """Console-script entry point."""
    import logging
    import os

    logging.basicConfig(level=os.environ.get("FW_LOG_LEVEL", "INFO").upper(), format="%(message)s")
    build_app()()


if __name__ == "__main__":
    main()
