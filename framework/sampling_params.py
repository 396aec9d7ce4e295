"""Per-request sampling parameters, in the shape vLLM and OpenAI users already know.

A `SamplingParams` travels from the API process to the engine process, so it is a
`msgspec.Struct`; it validates itself on construction, on `replace()` and on decoding, and
every error names the field, the value given and the valid range.
"""

from __future__ import annotations

import json as _json
import math
from typing import Any

import msgspec

_MAX_LOGPROBS = 20
_MAX_ABS_LOGIT_BIAS = 100.0
_MAX_ABS_OPENAI_PENALTY = 2.0
_GREEDY_TEMPERATURE = 1e-5
_CONSTRAINT_FIELDS = ("json", "json_object", "regex", "grammar", "choice", "structural_tag")


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A grammar that every generated token must keep the output inside (vLLM's field names).

    Exactly one constraint is given:

    ================  ==============================================================
    field             the output is
    ================  ==============================================================
    ``json``          JSON valid under this JSON Schema (a dict, or its JSON text).
    ``json_object``   any JSON object (OpenAI's ``{"type": "json_object"}``).
    ``regex``         a full match of this regular expression.
    ``grammar``       a sentence of this EBNF grammar (the GBNF dialect xgrammar reads;
                      the start rule is ``root``).
    ``choice``        exactly one of these strings.
    ``structural_tag`` text shaped by an xgrammar structural tag (its JSON text): free
                      text with constrained tags, e.g. tool calls (vLLM's field).
    ================  ==============================================================

    ``start_after``: the constraint applies only to the text generated after this string
    (e.g. ``"</think>"`` for a reasoning model); before it, generation is free.

    The struct checks its own shape; whether a schema, regex or grammar compiles is checked by
    the engine's grammar compiler, which reports the error to the caller.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    structural_tag: str | None = None
    start_after: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in _CONSTRAINT_FIELDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, json_object, regex, grammar, choice, structural_tag; "
                f"got {'none' if not given else ', '.join(given)}"
            )
        if isinstance(self.json, str):
            try:
                schema = _json.loads(self.json)
            except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than the parser recurses
                raise ValueError(
                    f"structured_outputs.json must be a JSON Schema, got text that is not JSON: "
                    f"{type(exc).__name__}: {str(exc)[:200]}"
                ) from None
            _check(isinstance(schema, (dict, bool)), "structured_outputs.json", self.json, "a JSON Schema object")
        for name in ("regex", "grammar", "structural_tag", "start_after"):
            value = getattr(self, name)
            _check(value is None or value != "", f"structured_outputs.{name}", value, "a non-empty string")
        if self.choice is not None:
            _check(len(self.choice) > 0, "structured_outputs.choice", self.choice, "a non-empty list of strings")
            for option in self.choice:
                _check(
                    isinstance(option, str) and option != "",
                    "structured_outputs.choice items",
                    option,
                    "non-empty strings",
                )

    @property
    def kind(self) -> str:
        """The constraint's field name: ``json``, ``json_object``, ``regex``, ``grammar``, ``choice`` or ``structural_tag``."""
        return next(name for name in _CONSTRAINT_FIELDS if getattr(self, name) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text, canonical enough to key a cache of compiled grammars."""
        value = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, str):
            value = _json.loads(value)
        return value if isinstance(value, str) else _json.dumps(value, sort_keys=True)


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to pick each next token of one request, and when to stop.

    ==============================  ==========================================================
    field                           meaning
    ==============================  ==========================================================
    ``n``                           completions to return for the prompt (>= 1).
    ``temperature``                 divides the logits; < 1e-5 means greedy (argmax).
    ``top_p``                       nucleus: keep the smallest set of most likely tokens whose
                                    probability sums to >= top_p; in (0, 1], 1 = off.
    ``top_k``                       keep the k most likely tokens; 0 or -1 = off (-1 is
                                    stored as 0).
    ``min_p``                       drop tokens less likely than min_p x the top token's
                                    probability; in [0, 1], 0 = off.
    ``presence_penalty``            OpenAI: subtracted once from every token already in the
                                    output; in [-2, 2].
    ``frequency_penalty``           OpenAI: subtracted per occurrence in the output; [-2, 2].
    ``repetition_penalty``          HF/CTRL: tokens seen in prompt or output get positive
                                    logits divided and negative ones multiplied; > 0, 1 = off.
    ``logit_bias``                  token id -> value in [-100, 100] added to its logit.
    ``seed``                        seeds a per-request generator: the same seed gives the
                                    same tokens whatever else shares the batch.
    ``max_tokens``                  tokens to generate at most (>= 1); None = until the model's
                                    max length.
    ``min_tokens``                  stop tokens (EOS, ``stop_token_ids``) are banned until this
                                    many tokens were generated.
    ``stop``                        strings that end the output (matched on the text).
    ``stop_token_ids``              token ids that end the output.
    ``include_stop_str_in_output``  keep the matched stop string in the returned text.
    ``ignore_eos``                  keep generating past EOS (until max_tokens / a stop).
    ``logprobs``                    None = no logprobs; 0 = the sampled token's logprob;
                                    k = also the k most likely alternatives; in [0, 20].
    ``prompt_logprobs``             as ``logprobs``, for every prompt token.
    ``skip_special_tokens``         drop special tokens when detokenizing.
    ``structured_outputs``          a `StructuredOutputsParams` grammar the output must follow
                                    (JSON schema, regex, EBNF, choice); None = free text.
    ==============================  ==========================================================

    Logprobs are of the model's raw distribution (before penalties, temperature and
    truncation), as in vLLM by default.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        # Comparisons are written as `not (valid)` so that NaN fails them too.
        _check(self.n >= 1, "n", self.n, ">= 1")
        _check(self.temperature >= 0, "temperature", self.temperature, ">= 0")
        _check(math.isfinite(self.temperature), "temperature", self.temperature, "finite")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _check(self.top_k == -1 or self.top_k >= 0, "top_k", self.top_k, "-1 or 0 (disabled), or >= 1")
        if self.top_k == -1:
            self.top_k = 0
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-_MAX_ABS_OPENAI_PENALTY <= value <= _MAX_ABS_OPENAI_PENALTY, name, value, "in [-2, 2]")
        _check(self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty, "> 0")
        _check(math.isfinite(self.repetition_penalty), "repetition_penalty", self.repetition_penalty, "finite")
        for token_id, bias in (self.logit_bias or {}).items():
            _check(token_id >= 0, "logit_bias token ids", token_id, ">= 0")
            _check(
                -_MAX_ABS_LOGIT_BIAS <= bias <= _MAX_ABS_LOGIT_BIAS, f"logit_bias[{token_id}]", bias, "in [-100, 100]"
            )
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", self.max_tokens, ">= 1 or None")
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, ">= 0")
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})"
            )
        if isinstance(self.stop, str):  # a single stop string is a common shorthand
            self.stop = [self.stop]
        for s in self.stop:
            _check(isinstance(s, str) and s != "", "stop strings", s, "non-empty")
        for token_id in self.stop_token_ids:
            _check(token_id >= 0, "stop_token_ids", token_id, ">= 0")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or 0 <= value <= _MAX_LOGPROBS, name, value, "in [0, 20] or None")

    @property
    def is_greedy(self) -> bool:
        """True when the sampler takes the argmax instead of sampling."""
        return self.temperature < _GREEDY_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        """True when presence, frequency or repetition penalty changes the logits."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def max_num_logprobs(self) -> int:
        """The most top-logprob alternatives asked for, by ``logprobs`` or ``prompt_logprobs``."""
        return max(self.logprobs or 0, self.prompt_logprobs or 0)

    def replace(self, **changes: Any) -> SamplingParams:
        """A validated copy with ``changes`` applied."""
        return msgspec.structs.replace(self, **changes)

    def clone(self) -> SamplingParams:
        """A deep copy (the lists and dict are not shared)."""
        return self.replace(
            logit_bias=None if self.logit_bias is None else dict(self.logit_bias),
            stop=list(self.stop),
            stop_token_ids=list(self.stop_token_ids),
            structured_outputs=None
            if self.structured_outputs is None
            else msgspec.structs.replace(self.structured_outputs),
        )


def _check(ok: bool, field: str, value: object, valid: str) -> None:
    if not ok:
        raise ValueError(f"{field} must be {valid}, got {value!r}")


#: The ``generation_config.json`` keys that are sampling defaults (the names match SamplingParams').
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(generation_config: dict[str, Any]) -> dict[str, float]:
    """The sampling defaults a model's ``generation_config.json`` declares (as vLLM applies them:
    whatever ``do_sample`` says); values that are not numbers are left out."""
    return {
        key: generation_config[key]
        for key in SAMPLING_DEFAULT_KEYS
        if isinstance(generation_config.get(key), int | float) and not isinstance(generation_config[key], bool)
    }
