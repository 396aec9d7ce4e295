"""The ``fw`` command-line interface (Typer); one module per command."""
