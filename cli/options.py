"""The engine options of ``fw serve`` / ``generate`` / ``bench``, generated from :class:`EngineArgs`."""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from typing import Annotated, Any

import typer

#: Engine options a command leaves out (it has its own flag of that name, or no use for it).
NOT_IN_GENERATE = frozenset({"seed"})  # --seed is the sampling seed there
NOT_IN_BENCH = frozenset(
    {"seed", "num_nodes", "node_rank", "master_addr", "master_port", "rendezvous_timeout", "distributed_timeout"}
)  # --seed is the prompts' seed; bench runs on one node


def with_engine_options(exclude: frozenset[str] = frozenset()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command one Typer option per :class:`~framework.engine.args.EngineArgs` field.

    The decorated function takes its own parameters plus ``engine``: the engine options the user
    gave, as an :class:`EngineOptions`. Flags, help text and defaults come from the fields, so
    ``fw serve``, ``fw generate`` and ``fw bench`` spell and default every engine option alike.
    """
    from framework.engine.args import engine_fields

    def wrap(function: Callable[..., Any]) -> Callable[..., Any]:
        hints = typing.get_type_hints(function, include_extras=True)
        own = [
            param.replace(annotation=hints[param.name], kind=inspect.Parameter.KEYWORD_ONLY)
            for param in inspect.signature(function).parameters.values()
            if param.name != "engine"
        ]
        generated = []
        for name, (base, meta, default) in engine_fields().items():
            if name in exclude:
                continue
            extra = meta.extra
            cli_name, cli_type, cli_default = name, base, default
            if extra["negate"]:  # enable_x=True <-> --disable-x not given
                cli_name, cli_type, cli_default = _negated_name(meta), bool, False
            elif name == "device_ids":
                cli_type = str | None  # --d 0,1
            option = typer.Option(*extra["flags"], help=meta.description, hidden=extra["hidden"])
            generated.append(
                inspect.Parameter(
                    cli_name,
                    inspect.Parameter.KEYWORD_ONLY,
                    default=cli_default,
                    annotation=Annotated[cli_type, option],
                )
            )
        cli_names = {param.name for param in generated}

        @functools.wraps(function)
        def command(**values: Any) -> Any:
            given = {name: values.pop(name) for name in list(values) if name in cli_names}
            return function(engine=EngineOptions(given), **values)

        del command.__wrapped__  # Typer reads the signature below, not the function's own
        arguments = [param for param in own if _is_argument(param)]  # positionals, then the engine's options
        ordered = arguments + generated + [param for param in own if not _is_argument(param)]
        command.__signature__ = inspect.Signature(ordered)
        command.__annotations__ = {param.name: param.annotation for param in ordered}
        return command

    return wrap


def _is_argument(param: inspect.Parameter) -> bool:
    return any(isinstance(m, typer.models.ArgumentInfo) for m in typing.get_args(param.annotation)[1:])


def _negated_name(meta: Any) -> str:
    """``--disable-cuda-graph`` -> ``disable_cuda_graph``."""
    return meta.extra["flags"][0].lstrip("-").replace("-", "_")


def cli_option_name(field: str) -> str:
    """The name a command's parameter for :class:`EngineArgs` ``field`` has (what :class:`EngineOptions`
    reads): the field's own, or for an ``enable_x`` field its ``--disable-x`` flag's (``disable_x``)."""
    from framework.engine.args import field_meta

    meta = field_meta(field)
    return _negated_name(meta) if meta.extra["negate"] else field


class EngineOptions:
    """The engine options of one command line; :meth:`args` turns them into validated EngineArgs."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values

    def get(self, name: str, default: Any = None) -> Any:
        """A value by its EngineArgs field name, as given (or ``default``)."""
        return self.values.get(name, default)

    def args(self, **overrides: Any) -> Any:
        """Validated :class:`EngineArgs` (names checked against the plugins, before any download).

        ``--d 0`` alone means ``--device cuda:0``; several ordinals (or ``--tp``) mean tensor
        parallelism over them. Raises :class:`framework.errors.ConfigError`.
        """
        from framework.engine.args import EngineArgs, engine_fields

        options = {}
        for name, (_, meta, _) in engine_fields().items():
            if meta.extra["negate"]:
                if _negated_name(meta) in self.values:
                    options[name] = not self.values[_negated_name(meta)]
            elif name in self.values:
                options[name] = self.values[name]
        options.update(overrides)
        ordinals = options.pop("device_ids", None)
        if isinstance(ordinals, str):
            ids = parse_ordinals(ordinals)
            tp, nodes = options.get("tensor_parallel_size") or 1, options.get("num_nodes") or 1
            if len(ids) == 1 and tp == 1 and nodes == 1:
                options["device"] = device_from_ordinals(ordinals, options.get("device"))
            else:
                options["device_ids"] = ids
        elif ordinals is not None:
            options["device_ids"] = ordinals
        args = EngineArgs.from_options(**options)
        args.check_names()
        return args


def engine_kwargs(**values: Any) -> dict[str, Any]:
    """Option values by their CLI spelling (``m``, ``d``, ``mem``, ``no_cuda_graph`` ...) or field
    name, as validated :class:`EngineBuilder` keyword arguments (for callers that hold flag values)."""
    aliases = {
        "m": "model",
        "w": "weights",
        "f": "file",
        "mem": "mem_mb",
        "tp": "tensor_parallel_size",
        "d": "device_ids",
        "no_prefix_cache": "disable_prefix_cache",
        "no_cuda_graph": "disable_cuda_graph",
    }
    values = {aliases.get(key, key): value for key, value in values.items()}
    return EngineOptions(values).args().to_dict()


def parse_ordinals(ordinals: str) -> list[int]:
    """``"0,1"`` -> ``[0, 1]``; anything but comma-separated GPU ordinals is an error."""
    from framework.errors import ConfigError

    parts = [p.strip() for p in ordinals.split(",") if p.strip()]
    if not parts or not all(p.isdigit() for p in parts):
        raise ConfigError(f"--d takes GPU ordinals like 0 or 0,1; got {ordinals!r}")
    return [int(p) for p in parts]


def device_from_ordinals(ordinals: str, device: str | None) -> str:
    """``--d 0`` -> ``cuda:0``; a conflicting ``--device`` is an error (several ordinals: tensor parallelism)."""
    from framework.errors import ConfigError

    parts = [str(p) for p in parse_ordinals(ordinals)]
    if len(parts) > 1:
        raise ConfigError(
            f"--d {ordinals}: several devices mean tensor parallelism; the engine takes them as device_ids"
        )
    if device and device != f"cuda:{parts[0]}":
        raise ConfigError(f"--d {ordinals} and --device {device} disagree; give one of them")
    return f"cuda:{parts[0]}"


def fail(message: str) -> typer.Exit:
    """Print a user-facing error and return the exit to raise."""
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(2)
