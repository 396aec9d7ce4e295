"""``fw generate``: one-shot generation from the command line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from cli import options as o


@o.with_engine_options(exclude=o.NOT_IN_GENERATE)
def generate(
    engine: o.EngineOptions,
    prompt: Annotated[str, typer.Argument(help="The prompt (with --chat: the user message).")],
    chat: Annotated[bool, typer.Option("--chat", help="Apply the model's chat template.")] = False,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Tokens to generate.")] = 64,
    temperature: Annotated[float, typer.Option("--temperature")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k")] = 0,
    seed: Annotated[int | None, typer.Option("--seed")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print token ids and metadata as JSON.")] = False,
    json_schema: Annotated[
        Path | None, typer.Option("--json-schema", help="A JSON Schema file: the output is JSON valid under it.")
    ] = None,
    regex: Annotated[str | None, typer.Option("--regex", help="The output is a full match of this regex.")] = None,
    choice: Annotated[
        list[str] | None, typer.Option("--choice", help="The output is one of these strings (repeat the option).")
    ] = None,
) -> None:
    """Generate a completion for PROMPT and print it."""
    from framework import LLM, SamplingParams
    from framework.errors import FwError

    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            structured_outputs=_structured_outputs(json_schema, regex, choice),
        )
        args = engine.args()
        kwargs = args.to_dict()
        if args.node_rank > 0:  # the other nodes only run their tensor-parallel workers
            from framework.engine.tp_worker import run_node

            raise typer.Exit(run_node(args))
        llm = LLM(**kwargs)
        if chat:
            result = llm.chat([{"role": "user", "content": prompt}], params)[0]
        else:
            result = llm.generate(prompt, params)[0]
        llm.close()
    except (FwError, ValueError) as exc:
        raise o.fail(str(exc)) from None
    output = result.outputs[0]
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "text": output.text,
                    "token_ids": output.token_ids,
                    "finish_reason": output.finish_reason,
                    "prompt_token_ids": result.prompt_token_ids,
                }
            )
        )
    else:
        typer.echo(output.text)


def _structured_outputs(json_schema: Path | None, regex: str | None, choice: list[str] | None):
    """``--json-schema`` / ``--regex`` / ``--choice`` as StructuredOutputsParams (None when none is given)."""
    from framework.sampling_params import StructuredOutputsParams

    if json_schema is None and regex is None and not choice:
        return None
    schema = None
    if json_schema is not None:
        try:
            schema = json.loads(json_schema.read_text())
        except OSError as exc:
            raise ValueError(f"--json-schema: cannot read {json_schema}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"--json-schema: {json_schema} is not JSON: {exc}") from None
    return StructuredOutputsParams(json=schema, regex=regex, choice=choice or None)
