"""The plugin contract: every hook fw calls, with when, arguments and how results combine.

Plugins implement these with ``@framework.hookimpl`` and declare their module under the
entry-point group ``fw``. Hooks are called with keyword arguments; an implementation may accept
any subset of them. Rules (DESIGN §2):

* ``register_*`` hooks run once per process at start-up and return lists of cheap specs
  (:mod:`framework.specs`); the implementation is imported only when selected.
* One-winner decisions are ``firstresult`` hooks; fw's own defaults are ``trylast`` so any
  installed plugin can override them by returning a non-``None`` value.
* No hook is called per token or per forward pass.
"""

from __future__ import annotations

from typing import Any

import pluggy

hookspec = pluggy.HookspecMarker("fw")


@hookspec
def register_model_architectures(platform: Any) -> list[Any]:
    """Return ``[ModelSpec]`` for the model architectures this plugin provides.

    Called once per process when the model registry is first built. ``platform`` is the
    :class:`framework.platform.Platform`. Results of all plugins are merged into one registry
    keyed by Hugging Face ``architectures[0]`` name; a name registered twice is an error naming
    both plugins.
    """


@hookspec
def register_weight_formats() -> list[Any]:
    """Return ``[WeightFormatSpec]`` for the weight formats this plugin can read.

    Called once per process. Merged into one registry; when a model source is opened, formats
    are asked in descending ``priority`` whether they recognise it, and the first that does
    loads it (config, tokenizer, weights).
    """


@hookspec
def register_quantization_methods() -> list[Any]:
    """Return ``[QuantMethodSpec]`` for the quantization methods this plugin provides.

        Called once per process. Merged into one registry keyed by method name (``gguf``, ``gptq``,
        ``awq``, ...); the chosen method's ``QuantConfig`` gives each layer its quant method
    (``get_quant_method``: a ``LinearMethod`` for linear layers and vocabulary tables, a
    ``FusedMoEMethod`` for ``FusedMoE``, the KV-cache method for attention layers) and declares
    the activation dtypes and devices it supports (see ``framework.quantization``). A spec's
    ``isq_types`` are the ``--isq`` names it offers (see ``framework.isq``).
    """


@hookspec(firstresult=True)
def resolve_quantization_method(
    model_config: Any, quantization_config: dict | None, requested: str | None, platform: Any
) -> str | None:
    """Name the quantization method for this model on this platform, or ``None`` to pass.

    Called once when a model is loaded. ``quantization_config`` is the checkpoint's
    (``config.json`` ``quantization_config`` or the weight format's), ``requested`` the user's
    choice (``--quantization``) or ``None``; with ``--isq`` the method offering the type is used and this hook is not asked. First non-``None`` result wins; fw's default (trylast)
    returns ``requested``, else the checkpoint's ``quant_method``, else ``None`` (unquantized).
    """


@hookspec
def register_kv_cache_dtypes() -> list[Any]:
    """Return ``[KVCacheDtypeSpec]`` for KV-cache storage types (``auto``, ``fp8``, ...).

    Called once per process; merged into one registry keyed by name, which ``--kv-cache-dtype``
    chooses from. A spec names the row format of keys and values (``model``, ``fp8``, ``int4``,
    ``int3``) and whether keys are rotated (:mod:`framework.kv_cache`); attention backends list
    the dtypes they read in their spec's ``kv_cache_dtypes``.
    """


@hookspec
def register_attention_backends(platform: Any) -> list[Any]:
    """Return ``[AttentionBackendSpec]`` for the attention backends this plugin provides.

    Called once per process; merged into one registry keyed by backend name. Backends that
    cannot run on ``platform`` may still be registered: their spec's requirements and their
    ``validate`` reasons are reported by ``fw plugins check`` and in selection errors.
    """


@hookspec(firstresult=True)
def select_attention_backend(
    candidates: list[Any], requested: str | None, model_config: Any, platform: Any
) -> str | None:
    """Name the attention backend to use, or ``None`` to pass.

    Called once per engine build. ``candidates`` are the ``AttentionBackendSpec`` s that validated
    for this model and platform, highest priority first; ``requested`` is the user's
    ``--attention-backend`` (``None`` or ``"auto"`` for automatic). First non-``None`` result wins;
    the answer must be one of the candidates. fw's default (trylast) returns ``requested`` when
    it is a candidate, else the highest-priority candidate.
    """


@hookspec
def register_kernels(platform: Any) -> list[Any]:
    """Return ``[KernelSpec]``: implementations of named ops for the kernel registry.

    Called once per process. Several plugins may implement the same op under different names;
    for each op the available implementation with the highest ``priority`` is used. fw's torch
    reference implementations (priority 0) run everywhere and are the test oracle.
    """


@hookspec
def register_tool_parsers() -> list[Any]:
    """Return ``[ParserSpec]`` (kind ``"tool"``) for tool-call output parsers.

    Called once per process; merged into one registry keyed by parser name
    (``--enforce-parser``). The parser class is instantiated once per request.
    """


@hookspec
def register_reasoning_parsers() -> list[Any]:
    """Return ``[ParserSpec]`` (kind ``"reasoning"``) for reasoning-output parsers.

    Called once per process; merged into one registry keyed by parser name.
    """


@hookspec(firstresult=True)
def default_parsers(model_config: Any, chat_template: str | None) -> dict | None:
    """Pick parsers for a model when the user named none, or ``None`` to pass.

    Called once per served model (the API server calls it with ``model_config=None`` and the
    tokenizer's ``chat_template`` text). Returns ``{"tool": name | None, "reasoning": name | None}``,
    typically from the chat template. First non-``None`` result wins; fw's default (trylast)
    returns no parsers.
    """


@hookspec
def register_routes() -> list[Any]:
    """Return extra HTTP route handlers (Litestar handlers or routers) for the API server.

    Called once when the server app is created; all plugins' lists are concatenated.
    """


@hookspec
def app_init(app_config: Any) -> None:
    """Adjust the Litestar ``AppConfig`` (middleware, plugins, exception handlers) in place.

    Called once when the server app is created, after routes are collected; every
    implementation runs.
    """


@hookspec
def register_commands(app: Any) -> None:
    """Add sub-commands to the ``fw`` Typer ``app`` (``@app.command()``).

    Called once when the CLI starts, before arguments are parsed; every implementation runs.
    Must stay cheap: do heavy imports inside the command functions.
    """


@hookspec
def startup(engine: Any) -> Any:
    """Called once after the engine is built, before it serves; may return an awaitable (awaited).

    Every implementation runs; ``engine`` is the built engine (``LLM``: the in-process
    :class:`~framework.engine.built_engine.Engine`) or, in the API server, its engine client once
    the engine reports ready.
    """


@hookspec
def shutdown(engine: Any) -> Any:
    """Called once when the engine stops (``LLM.close()``; the API server's shutdown), after a
    ``startup`` call; may return an awaitable (awaited). Every implementation runs."""
