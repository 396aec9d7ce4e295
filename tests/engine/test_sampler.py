"""The reference sampler against per-row references: plain Python loops and transformers' processors."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from framework.engine.sampler import (
    Sampler,
    apply_logit_bias,
    apply_min_p,
    apply_min_tokens,
    apply_penalties,
    apply_temperature,
    apply_top_k_top_p,
    compute_logprobs,
    make_generator,
)
from framework.sampling_params import SamplingParams

VOCAB_SIZE = 1000


@dataclass
class Row:
    sampling_params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


@pytest.fixture(autouse=True)
def _seed_global_rng():
    torch.manual_seed(1234)


def random_logits(num_rows: int, vocab_size: int = VOCAB_SIZE, scale: float = 3.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab_size, generator=g) * scale


def random_tokens(n: int, high: int, seed: int) -> list[int]:
    """Token ids drawn from a small range, so that many repeat."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, high, (n,), generator=g).tolist()


def kept(logits: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(torch.isfinite(row)).flatten().tolist()) for row in logits]


# ---------------------------------------------------------------------------------- the steps


def test_logit_bias_adds_each_rows_own_bias():
    logits = random_logits(3)
    biases = [{5: 100.0, 17: -3.5, 999: 0.25}, None, {5: -100.0, 0: 42.0}]
    params = [SamplingParams(logit_bias=b) for b in biases]

    out = apply_logit_bias(logits, params)

    expected = logits.clone()
    for i, bias in enumerate(biases):
        for token_id, value in (bias or {}).items():
            expected[i, token_id] += value
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert out[0, 5] > 90 and out[2, 5] < -90


def test_repetition_penalty_matches_transformers_over_prompt_and_output():
    logits = random_logits(4, seed=1)
    penalties = [1.3, 0.7, 1.0, 2.5]
    rows = [
        Row(
            SamplingParams(repetition_penalty=p),
            prompt_token_ids=random_tokens(40, 120, seed=10 + i),
            output_token_ids=random_tokens(25, 200, seed=20 + i),
        )
        for i, p in enumerate(penalties)
    ]

    out = apply_penalties(logits, rows)

    for i, row in enumerate(rows):
        input_ids = torch.tensor([row.prompt_token_ids + row.output_token_ids])
        expected = RepetitionPenaltyLogitsProcessor(penalties[i])(input_ids, logits[i : i + 1].clone())
        torch.testing.assert_close(out[i : i + 1], expected, rtol=0, atol=0)
    seen = set(rows[0].prompt_token_ids)
    assert any(out[0, t] != logits[0, t] for t in seen)  # the penalty did something


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = random_logits(3, seed=2)
    settings = [(0.5, 0.0), (0.0, 1.5), (-0.7, 0.9)]  # (presence, frequency)
    rows = [
        Row(
            SamplingParams(presence_penalty=pres, frequency_penalty=freq),
            prompt_token_ids=list(range(500, 540)),
            output_token_ids=random_tokens(60, 50, seed=30 + i),
        )
        for i, (pres, freq) in enumerate(settings)
    ]

    out = apply_penalties(logits, rows)

    expected = logits.clone()
    for i, row in enumerate(rows):
        presence, frequency = settings[i]
        for token_id, count in Counter(row.output_token_ids).items():
            expected[i, token_id] -= frequency * count + presence
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(out[:, 500:540], logits[:, 500:540], rtol=0, atol=0)  # prompt untouched


def test_repetition_penalty_comes_before_openai_penalties():
    logits = random_logits(1, seed=3)
    row = Row(
        SamplingParams(repetition_penalty=1.8, frequency_penalty=0.4, presence_penalty=0.3),
        prompt_token_ids=random_tokens(30, 100, seed=4),
        output_token_ids=random_tokens(30, 100, seed=5),
    )

    out = apply_penalties(logits, [row])

    input_ids = torch.tensor([row.prompt_token_ids + row.output_token_ids])
    expected = RepetitionPenaltyLogitsProcessor(1.8)(input_ids, logits.clone())
    for token_id, count in Counter(row.output_token_ids).items():
        expected[0, token_id] -= 0.4 * count + 0.3
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-5)


def test_rows_without_penalties_are_left_alone_and_a_batch_without_any_skips_the_work():
    logits = random_logits(3, seed=6)
    rows = [
        Row(SamplingParams(), [1, 2, 3], [4, 4]),
        Row(SamplingParams(frequency_penalty=1.0), [1, 2, 3], [4, 4]),
        Row(SamplingParams(), [7], [7]),
    ]
    out = apply_penalties(logits, rows)
    torch.testing.assert_close(out[[0, 2]], logits[[0, 2]], rtol=0, atol=0)
    assert out[1, 4] == pytest.approx(logits[1, 4].item() - 2.0, abs=1e-5)

    plain = [Row(SamplingParams(), [1, 2, 3], [4, 4])] * 3
    assert apply_penalties(logits, plain) is logits


def test_temperature_divides_the_logits_of_sampled_rows():
    logits = random_logits(3, seed=7)
    params = [SamplingParams(temperature=0.5), SamplingParams(temperature=0.0), SamplingParams(temperature=1.7)]
    out = apply_temperature(logits, params)
    torch.testing.assert_close(out[0:1], TemperatureLogitsWarper(0.5)(None, logits[0:1].clone()), rtol=0, atol=0)
    torch.testing.assert_close(out[1], logits[1], rtol=0, atol=0)  # greedy: argmax only
    torch.testing.assert_close(out[2:3], TemperatureLogitsWarper(1.7)(None, logits[2:3].clone()), rtol=0, atol=0)


def test_min_p_keeps_the_tokens_transformers_keeps():
    logits = random_logits(4, seed=8)
    min_ps = [0.05, 0.3, 0.0, 1.0]
    out = apply_min_p(logits, [SamplingParams(min_p=m) for m in min_ps])
    for i, min_p in enumerate(min_ps):
        expected = logits[i : i + 1] if min_p == 0 else MinPLogitsWarper(min_p)(None, logits[i : i + 1].clone())
        assert kept(out[i : i + 1]) == kept(expected)
    sizes = [len(s) for s in kept(out)]
    assert 1 < sizes[0] < VOCAB_SIZE and sizes[1] < sizes[0] and sizes[2] == VOCAB_SIZE and sizes[3] == 1


def test_top_k_keeps_the_tokens_transformers_keeps_ties_included():
    logits = random_logits(5, seed=9)
    logits[4] = torch.round(logits[4])  # many ties with the k-th value
    top_ks = [1, 7, 300, 0, 50]
    out = apply_top_k_top_p(logits, [SamplingParams(top_k=k) for k in top_ks])
    for i, k in enumerate(top_ks):
        expected = logits[i : i + 1] if k == 0 else TopKLogitsWarper(k)(None, logits[i : i + 1].clone())
        assert kept(out[i : i + 1]) == kept(expected)
    torch.testing.assert_close(out[torch.isfinite(out)], logits[torch.isfinite(out)], rtol=0, atol=0)
    assert [len(s) for s in kept(out)][:4] == [1, 7, 300, VOCAB_SIZE]
    assert len(kept(out)[4]) > 50


def test_top_p_keeps_the_smallest_nucleus_transformers_keeps():
    logits = random_logits(5, seed=10, scale=2.0)
    top_ps = [0.1, 0.5, 0.95, 1.0, 1e-6]
    out = apply_top_k_top_p(logits, [SamplingParams(top_p=p) for p in top_ps])
    probs = logits.double().softmax(-1)
    for i, top_p in enumerate(top_ps):
        expected = TopPLogitsWarper(top_p)(None, logits[i : i + 1].clone())
        assert kept(out[i : i + 1]) == kept(expected)
        # Independently, in float64: the shortest prefix of the sorted probabilities whose mass
        # reaches top_p (the seeded logits keep every boundary far from float32 rounding).
        ordered = sorted(probs[i].tolist(), reverse=True)
        mass, size = 0.0, 0
        while size < len(ordered) and mass < top_p:
            mass += ordered[size]
            size += 1
        if top_p < 1.0:
            assert len(kept(out)[i]) == size
    assert len(kept(out)[4]) == 1 and len(kept(out)[3]) == VOCAB_SIZE


def test_top_k_then_top_p_matches_the_transformers_chain():
    logits = random_logits(3, seed=11, scale=1.0)
    settings = [(40, 0.6), (5, 0.99), (0, 0.3)]
    out = apply_top_k_top_p(logits, [SamplingParams(top_k=k, top_p=p) for k, p in settings])
    for i, (k, p) in enumerate(settings):
        expected = logits[i : i + 1].clone()
        if k:
            expected = TopKLogitsWarper(k)(None, expected)
        expected = TopPLogitsWarper(p)(None, expected)
        assert kept(out[i : i + 1]) == kept(expected)


def test_min_tokens_bans_stop_tokens_and_eos_unless_ignore_eos():
    logits = random_logits(3, seed=12)
    rows = [
        Row(SamplingParams(min_tokens=5, stop_token_ids=[10, 11]), output_token_ids=[1, 2]),
        Row(SamplingParams(min_tokens=5, stop_token_ids=[10], ignore_eos=True), output_token_ids=[1]),
        Row(SamplingParams(min_tokens=2, stop_token_ids=[10]), output_token_ids=[1, 2]),
    ]
    out = apply_min_tokens(logits, rows, eos_token_ids=[2])
    assert kept(out)[0] == set(range(VOCAB_SIZE)) - {2, 10, 11}
    assert kept(out)[1] == set(range(VOCAB_SIZE)) - {10}
    torch.testing.assert_close(out[2], logits[2], rtol=0, atol=0)  # min_tokens reached


# ---------------------------------------------------------------------------- the whole sampler


def reference_penalized(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """Bias, repetition (transformers), then presence/frequency, row by row."""
    out = logits.clone().float()
    for i, row in enumerate(rows):
        p = row.sampling_params
        for token_id, value in (p.logit_bias or {}).items():
            out[i, token_id] += value
        if p.repetition_penalty != 1.0:
            input_ids = torch.tensor([row.prompt_token_ids + row.output_token_ids])
            out[i : i + 1] = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(input_ids, out[i : i + 1].clone())
        for token_id, count in Counter(row.output_token_ids).items():
            out[i, token_id] -= p.frequency_penalty * count + p.presence_penalty
    return out


def reference_probs(logits: torch.Tensor, row: Row) -> torch.Tensor:
    """The distribution a sampled row draws from: penalties, then the transformers warpers."""
    p = row.sampling_params
    scores = reference_penalized(logits[None], [row])
    scores = TemperatureLogitsWarper(p.temperature)(None, scores)
    if p.min_p > 0:
        scores = MinPLogitsWarper(p.min_p)(None, scores)
    if p.top_k > 0:
        scores = TopKLogitsWarper(p.top_k)(None, scores)
    if p.top_p < 1:
        scores = TopPLogitsWarper(p.top_p)(None, scores)
    return scores.softmax(-1)[0]


def test_greedy_rows_take_the_argmax_after_bias_and_penalties():
    logits = random_logits(4, seed=13)
    raw_best = logits.argmax(-1).tolist()
    rows = [
        Row(SamplingParams(temperature=0.0, frequency_penalty=2.0), [1, 2], [raw_best[0]] * 3),
        Row(SamplingParams(temperature=0.0, repetition_penalty=3.0), [raw_best[1]], []),
        Row(SamplingParams(temperature=0.0, logit_bias={3: 30.0}), [1], [2]),
        Row(SamplingParams(temperature=0.8, top_k=5), [1], [2]),  # a sampled row in the batch
    ]
    out = Sampler()(logits, rows)
    expected = reference_penalized(logits, rows).argmax(-1).tolist()
    assert out.token_ids.tolist()[:3] == expected[:3]
    assert expected[0] != raw_best[0] and expected[1] != raw_best[1] and expected[2] == 3
    assert out.token_ids[3].item() in set(logits[3].topk(5).indices.tolist())


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_k=6, top_p=0.8),
        SamplingParams(temperature=1.3, min_p=0.08),
        SamplingParams(
            temperature=1.0,
            top_p=0.9,
            repetition_penalty=1.5,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            logit_bias={0: 1.5},
        ),
    ],
    ids=["temperature-top_k-top_p", "min_p", "penalties-bias-top_p"],
)
def test_sampled_frequencies_match_the_reference_distribution(params):
    vocab_size, num_samples = 12, 20_000
    row_logits = random_logits(1, vocab_size, scale=1.5, seed=14)[0]
    rows = [Row(params, prompt_token_ids=[1, 2, 3], output_token_ids=[3, 3, 5])] * num_samples

    out = Sampler()(row_logits.expand(num_samples, vocab_size), rows)

    expected = reference_probs(row_logits, rows[0]).double()
    counts = torch.bincount(out.token_ids, minlength=vocab_size).double()
    support = expected > 0
    assert counts[~support].sum() == 0, "sampled a token the reference excluded"
    assert 2 <= support.sum() < vocab_size  # the test exercises truncation
    # Pearson's chi-square against the 1e-6 upper quantile (Wilson-Hilferty approximation):
    # with the global RNG seeded this is deterministic, and a wrong distribution blows far past it.
    expected_counts = expected[support] * num_samples
    chi2 = (((counts[support] - expected_counts) ** 2) / expected_counts).sum().item()
    df = int(support.sum()) - 1
    z = 4.753  # one-sided normal quantile of 1e-6
    bound = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    assert chi2 < bound, (chi2, bound, counts.tolist(), expected_counts.tolist())


def generate_with_seed(seed: int, batch_position: int, others: list[SamplingParams], steps: int = 20) -> list[int]:
    """Run `steps` decode steps of one seeded request placed among `others` at `batch_position`."""
    sampler = Sampler()
    params = SamplingParams(seed=seed, temperature=0.9, top_k=200, top_p=0.95, frequency_penalty=0.2)
    target = Row(params, prompt_token_ids=[5, 6, 7], generator=make_generator(seed, "cpu"))
    other_rows = [Row(p, [1, 2], [3], None if p.seed is None else make_generator(p.seed, "cpu")) for p in others]
    rows = other_rows[:batch_position] + [target] + other_rows[batch_position:]
    for step in range(steps):
        logits = random_logits(len(rows), seed=1000 + step + 97 * len(rows) + batch_position)
        logits[batch_position] = random_logits(1, seed=step)[0]  # the target's model output
        token = sampler(logits, rows).token_ids[batch_position].item()
        target.output_token_ids.append(token)
    return target.output_token_ids


def test_a_seeded_request_samples_the_same_tokens_whatever_its_batch():
    alone = generate_with_seed(42, 0, [])
    torch.manual_seed(7)  # the unseeded rows draw from a different global state
    crowded = generate_with_seed(
        42,
        2,
        [SamplingParams(), SamplingParams(seed=42), SamplingParams(temperature=0.0), SamplingParams(seed=5, top_k=3)],
    )
    torch.manual_seed(8)
    first = generate_with_seed(42, 0, [SamplingParams(top_p=0.5), SamplingParams(seed=1)])
    assert alone == crowded == first
    assert len(set(alone)) > 10  # it really samples

    assert generate_with_seed(43, 0, []) != alone


def test_logprobs_are_of_the_raw_distribution_with_top_k_per_batch():
    logits = random_logits(4, seed=15).to(torch.bfloat16)
    rows = [
        Row(SamplingParams(logprobs=3, temperature=0.5, top_k=10, repetition_penalty=1.4), [1, 2], [2, 9]),
        Row(SamplingParams(logprobs=None, top_p=0.3)),
        Row(SamplingParams(logprobs=5, temperature=0.0, logit_bias={17: 50.0})),
        Row(SamplingParams(logprobs=0, min_p=0.2)),
    ]

    out = Sampler()(logits, rows)

    assert out.token_ids[2].item() == 17
    assert out.top_logprob_ids.shape == (4, 5) and out.top_logprobs.dtype == torch.float32
    raw = logits.float()
    for i in range(4):
        values = raw[i].tolist()
        log_z = max(values) + math.log(sum(math.exp(v - max(values)) for v in values))
        token = out.token_ids[i].item()
        assert out.logprobs[i].item() == pytest.approx(values[token] - log_z, abs=1e-4)
        ranked = sorted(range(len(values)), key=lambda t: -values[t])[:5]
        assert [values[t] for t in out.top_logprob_ids[i].tolist()] == [values[t] for t in ranked]  # ties in bf16
        torch.testing.assert_close(
            out.top_logprobs[i], torch.tensor([values[t] - log_z for t in ranked]), rtol=0, atol=1e-4
        )
    assert out.logprobs[2].item() < -1.0  # the raw logprob, not the biased one
    assert out.top_logprobs[0].diff().le(0).all()


def test_logprobs_are_none_when_no_row_asked_and_top_none_when_all_asked_zero():
    logits = random_logits(2, seed=16)
    none = Sampler()(logits, [Row(SamplingParams()), Row(SamplingParams(temperature=0.0))])
    assert none.logprobs is None and none.top_logprob_ids is None and none.top_logprobs is None

    zero = Sampler()(logits, [Row(SamplingParams(logprobs=0)), Row(SamplingParams(temperature=0.0))])
    assert zero.top_logprob_ids is None and zero.top_logprobs is None
    expected = torch.log_softmax(logits, -1).gather(1, zero.token_ids[:, None])[:, 0]
    torch.testing.assert_close(zero.logprobs, expected)


def test_compute_logprobs_for_prompt_tokens():
    logits = random_logits(6, vocab_size=50, seed=17)
    next_tokens = torch.tensor([3, 49, 0, 3, 12, 7])
    out = compute_logprobs(logits, next_tokens, num_top=4)
    for i in range(6):
        values = logits[i].tolist()
        log_z = math.log(sum(math.exp(v) for v in values))
        assert out.token_logprobs[i].item() == pytest.approx(values[next_tokens[i]] - log_z, abs=1e-4)
        ranked = sorted(range(50), key=lambda t: -values[t])[:4]
        assert out.top_ids[i].tolist() == ranked
    assert compute_logprobs(logits, next_tokens, 0).top_ids is None


def test_sampler_accepts_half_precision_and_leaves_the_input_untouched():
    logits = random_logits(3, seed=18)
    before = logits.clone()
    rows = [
        Row(SamplingParams(frequency_penalty=1.0, logit_bias={1: 5.0}), [1], [1, 1]),
        Row(SamplingParams(top_k=3)),
        Row(SamplingParams(temperature=0.0)),
    ]
    Sampler()(logits, rows)
    torch.testing.assert_close(logits, before, rtol=0, atol=0)

    out = Sampler()(logits.half(), rows)
    assert out.token_ids.dtype == torch.int64 and out.token_ids[2].item() == logits.half().argmax(-1)[2].item()
