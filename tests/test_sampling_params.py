"""SamplingParams: vLLM's defaults, validation messages, and the trip across a process boundary."""

from __future__ import annotations

import msgspec
import pytest

from framework.sampling_params import SamplingParams


def test_defaults_are_vllms():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids) == (16, 0, [], [])
    assert (p.logprobs, p.prompt_logprobs, p.seed, p.logit_bias) == (None, None, None, None)
    assert p.skip_special_tokens and not p.ignore_eos and not p.include_stop_str_in_output
    assert SamplingParams().stop is not SamplingParams().stop  # no shared mutable default


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -1}, "temperature must be >= 0, got -1"),
        ({"temperature": float("inf")}, "temperature must be finite, got inf"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_p": float("nan")}, "top_p must be in (0, 1], got nan"),
        ({"top_k": -2}, "top_k must be -1 or 0 (disabled), or >= 1, got -2"),
        ({"min_p": 1.2}, "min_p must be in [0, 1], got 1.2"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
        ({"frequency_penalty": -3.0}, "frequency_penalty must be in [-2, 2], got -3.0"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0, got 0.0"),
        ({"n": 0}, "n must be >= 1, got 0"),
        ({"max_tokens": 0}, "max_tokens must be >= 1 or None, got 0"),
        ({"min_tokens": -1}, "min_tokens must be >= 0, got -1"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens must be <= max_tokens (10), got 20"),
        ({"logprobs": 21}, "logprobs must be in [0, 20] or None, got 21"),
        ({"prompt_logprobs": -1}, "prompt_logprobs must be in [0, 20] or None, got -1"),
        ({"logit_bias": {5: 150.0}}, "logit_bias[5] must be in [-100, 100], got 150.0"),
        ({"logit_bias": {-3: 1.0}}, "logit_bias token ids must be >= 0, got -3"),
        ({"stop": ["ok", ""]}, "stop strings must be non-empty, got ''"),
        ({"stop_token_ids": [2, -1]}, "stop_token_ids must be >= 0, got -1"),
    ],
)
def test_invalid_values_fail_naming_field_value_and_range(kwargs, message):
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**kwargs)
    assert str(excinfo.value) == message


def test_edges_of_the_valid_ranges_are_accepted():
    p = SamplingParams(
        temperature=0.0,
        top_p=1.0,
        min_p=1.0,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        repetition_penalty=0.01,
        logprobs=20,
        prompt_logprobs=0,
        max_tokens=None,
        min_tokens=50,
        logit_bias={0: -100.0, 7: 100.0},
    )
    assert p.max_tokens is None and p.min_tokens == 50


def test_top_k_minus_one_means_disabled_and_is_stored_as_zero():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=40).top_k == 40


def test_a_single_stop_string_becomes_a_list():
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]


def test_helper_properties():
    assert SamplingParams(temperature=0.0).is_greedy and SamplingParams(temperature=5e-6).is_greedy
    assert not SamplingParams(temperature=1e-4).is_greedy
    assert not SamplingParams().needs_penalties
    assert SamplingParams(presence_penalty=0.1).needs_penalties
    assert SamplingParams(frequency_penalty=-0.1).needs_penalties
    assert SamplingParams(repetition_penalty=1.1).needs_penalties
    assert SamplingParams().max_num_logprobs == 0
    assert SamplingParams(logprobs=3, prompt_logprobs=7).max_num_logprobs == 7


def test_replace_validates_and_clone_shares_nothing():
    p = SamplingParams(temperature=0.5, stop=["x"], logit_bias={1: 2.0})
    assert p.replace(temperature=0.9).temperature == 0.9 and p.temperature == 0.5
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 2"):
        p.replace(top_p=2)
    copy = p.clone()
    copy.stop.append("y")
    copy.logit_bias[3] = 1.0
    assert (
        p.stop == ["x"] and p.logit_bias == {1: 2.0} and copy == p.replace(stop=["x", "y"], logit_bias={1: 2.0, 3: 1.0})
    )


@pytest.mark.parametrize("codec", [msgspec.msgpack, msgspec.json], ids=["msgpack", "json"])
def test_round_trips_through_msgspec(codec):
    p = SamplingParams(
        n=2,
        temperature=0.3,
        top_k=-1,
        logit_bias={50256: -100.0, 7: 2.5},
        seed=11,
        stop=["</s>"],
        stop_token_ids=[2],
        logprobs=5,
        max_tokens=None,
    )
    decoded = codec.decode(codec.encode(p), type=SamplingParams)
    assert decoded == p and decoded.logit_bias == {50256: -100.0, 7: 2.5} and decoded.max_tokens is None


def test_decoding_validates_too():
    with pytest.raises(msgspec.ValidationError, match="temperature must be >= 0, got -0.5"):
        msgspec.json.decode(b'{"temperature": -0.5}', type=SamplingParams)
    decoded = msgspec.json.decode(b'{"logit_bias": {"42": 3}, "top_k": -1}', type=SamplingParams)
    assert decoded.logit_bias == {42: 3.0} and decoded.top_k == 0


# --- structured outputs ------------------------------------------------------------------
def test_structured_outputs_take_exactly_one_constraint():
    from framework.sampling_params import StructuredOutputsParams

    assert StructuredOutputsParams(json={"type": "object"}).kind == "json"
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    assert StructuredOutputsParams(choice=["yes", "no"], start_after="</think>").kind == "choice"
    with pytest.raises(ValueError, match="exactly one of json, json_object, regex, grammar, choice; got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got regex, choice"):
        StructuredOutputsParams(regex="a+", choice=["a"])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"json": "{not json"}, "structured_outputs.json must be a JSON Schema, got text that is not JSON"),
        ({"json": "[1, 2]"}, "structured_outputs.json must be a JSON Schema object"),
        ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
        ({"choice": []}, "structured_outputs.choice must be a non-empty list of strings"),
        ({"choice": ["a", ""]}, "structured_outputs.choice items must be non-empty strings"),
        ({"grammar": 'root ::= "a"', "start_after": ""}, "structured_outputs.start_after must be a non-empty string"),
    ],
)
def test_structured_outputs_errors_name_the_field(kwargs, message):
    from framework.sampling_params import StructuredOutputsParams

    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        StructuredOutputsParams(**kwargs)


def test_structured_outputs_cross_the_process_boundary_and_key_the_cache():
    from framework.sampling_params import StructuredOutputsParams

    params = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object", "required": ["a"]}))
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert decoded == params
    # the same schema as a dict or as text (any key order) is one cache entry
    as_text = StructuredOutputsParams(json='{"required": ["a"], "type": "object"}')
    assert as_text.spec == params.structured_outputs.spec
    with pytest.raises(msgspec.ValidationError, match="exactly one"):
        msgspec.json.decode(
            b'{"structured_outputs": {"regex": "a", "grammar": "root ::= \\"a\\""}}', type=SamplingParams
        )
    assert params.clone().structured_outputs == params.structured_outputs
