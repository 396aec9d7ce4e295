"""The reference sampler: logits of one decode step -> one token id per request.

Pure torch, device-agnostic (CPU and CUDA), computed in float32. The steps, in vLLM's order:

    raw logits ──► logprobs (log_softmax of the raw logits; only if a row asked)
        │
        ├─ logit_bias (add), min_tokens (ban stop tokens while the output is too short)
        ├─ repetition penalty    (HF: prompt + output tokens; logit > 0 divided, < 0 multiplied)
        ├─ frequency / presence  (OpenAI: output tokens; logit -= freq * count + pres * (count > 0))
        ├─ greedy rows: argmax
        └─ other rows: temperature → min_p → top_k → top_p → exponential race

Everything is vectorized over the batch; Python loops over rows only gather the per-request
lists into one tensor, and draw the noise of rows that own a seeded generator. A batch pays
only for what it asked: no penalties means no count tensors, all greedy means no softmax.
Parameter tensors are built from Python values and cross without blocking (``to_device``);
nothing reads a device tensor back to the host.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import numpy as np
import torch

from framework.engine.transfer import to_device
from framework.sampling_params import SamplingParams

__all__ = [
    "Sampler",
    "apply_logit_bias",
    "apply_min_p",
    "apply_min_tokens",
    "apply_penalties",
    "apply_temperature",
    "apply_top_k_top_p",
    "exponential_race",
    "SamplerOutput",
    "SamplingRow",
    "TokenLogprobs",
    "compute_logprobs",
    "make_generator",
]


class SamplingRow(Protocol):
    """What the sampler reads of one request (one row of the logits)."""

    sampling_params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None  # from make_generator(params.seed, device), kept per request


class SamplerOutput(NamedTuple):
    token_ids: torch.Tensor  # [R] int64
    logprobs: torch.Tensor | None  # [R] float32, raw logprob of each sampled token; None if no row asked
    top_logprob_ids: torch.Tensor | None  # [R, K] int64, K = max `logprobs` in the batch; None if K == 0
    top_logprobs: torch.Tensor | None  # [R, K] float32, sorted descending


class TokenLogprobs(NamedTuple):
    token_logprobs: torch.Tensor  # [N] float32
    top_ids: torch.Tensor | None  # [N, num_top] int64, None when num_top == 0
    top_logprobs: torch.Tensor | None  # [N, num_top] float32, sorted descending


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator for one seeded request; the engine keeps it for the request's lifetime."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)  # any Python int is a valid seed
    return generator


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> TokenLogprobs:
    """Logprobs of ``token_ids`` under ``logits`` [N, V], and the ``num_top`` most likely tokens.

    Used for the sampled tokens and, by the engine, for prompt logprobs (logits of position i
    against prompt token i + 1).
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    token_logprobs = logprobs.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1)
    num_top = min(num_top, logprobs.shape[-1])
    if num_top <= 0:
        return TokenLogprobs(token_logprobs, None, None)
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1, sorted=True)
    return TokenLogprobs(token_logprobs, top_ids, top_logprobs)


class Sampler:
    """Samples one token per row; stateless apart from the rows' own generators.

    ``eos_token_ids`` are the model's end-of-sequence ids: ``min_tokens`` bans them (besides
    each request's ``stop_token_ids``) unless the request set ``ignore_eos``.
    """

    def __init__(self, *, eos_token_ids: Sequence[int] = ()) -> None:
        self.eos_token_ids = tuple(eos_token_ids)

    def __call__(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], pending: torch.Tensor | None = None
    ) -> SamplerOutput:
        """Sample one token per row. ``pending`` ([R] int64, on the logits' device) is for async
        scheduling: a row whose last output token is still a placeholder on the host has that
        token's id there (-1 elsewhere), so the penalties count it without reading it back."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (tuple(logits.shape), len(rows))
        params = [row.sampling_params for row in rows]
        raw_logits = logits.float()  # every step is out-of-place: the caller's tensor is untouched

        logits = apply_logit_bias(raw_logits, params)
        logits = apply_min_tokens(logits, rows, self.eos_token_ids)
        logits = apply_penalties(logits, rows, pending)

        is_greedy = [p.is_greedy for p in params]
        if all(is_greedy):
            token_ids = logits.argmax(dim=-1)
        elif not any(is_greedy):
            token_ids = _sample(logits, rows)
        else:
            token_ids = logits.argmax(dim=-1)
            sampled = [i for i, greedy in enumerate(is_greedy) if not greedy]
            index = _tensor(sampled, torch.int64, logits.device)
            token_ids[index] = _sample(logits[index], [rows[i] for i in sampled])

        asked = [p.logprobs for p in params if p.logprobs is not None]
        if not asked:
            return SamplerOutput(token_ids, None, None, None)
        out = compute_logprobs(raw_logits, token_ids, max(asked))
        return SamplerOutput(token_ids, out.token_logprobs, out.top_ids, out.top_logprobs)


def _sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    params = [row.sampling_params for row in rows]
    logits = apply_temperature(logits, params)
    logits = apply_min_p(logits, params)
    logits = apply_top_k_top_p(logits, params)
    return exponential_race(logits.softmax(dim=-1), [row.generator for row in rows])


# The steps. Each takes float32 logits [R, V] and the R rows' parameters, returns new logits
# (never modifies its input), and returns its input unchanged when no row needs it.


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Add each row's ``logit_bias`` to its logits."""
    row_idx, token_idx, values = [], [], []
    vocab_size = logits.shape[-1]
    for i, p in enumerate(params):
        for token_id, bias in (p.logit_bias or {}).items():
            # Ids past the logits (the engine checks them against the vocab up front) are
            # dropped: an out-of-range index is a device-side assert on CUDA.
            if token_id < vocab_size:
                row_idx.append(i)
                token_idx.append(token_id)
                values.append(bias)
    if not row_idx:
        return logits
    device = logits.device
    index = (_tensor(row_idx, torch.int64, device), _tensor(token_idx, torch.int64, device))
    return logits.index_put(index, _tensor(values, torch.float32, device), accumulate=True)


def apply_min_tokens(
    logits: torch.Tensor, rows: Sequence[SamplingRow], eos_token_ids: Sequence[int] = ()
) -> torch.Tensor:
    """Ban the stop tokens (``stop_token_ids``, and EOS unless ``ignore_eos``) of rows that
    have generated fewer than ``min_tokens`` tokens."""
    row_idx, token_idx = [], []
    vocab_size = logits.shape[-1]
    for i, row in enumerate(rows):
        p = row.sampling_params
        if len(row.output_token_ids) >= p.min_tokens:
            continue
        banned = set(p.stop_token_ids) if p.ignore_eos else {*p.stop_token_ids, *eos_token_ids}
        banned = [t for t in banned if t < vocab_size]
        row_idx += [i] * len(banned)
        token_idx += banned
    if not row_idx:
        return logits
    device = logits.device
    index = (_tensor(row_idx, torch.int64, device), _tensor(token_idx, torch.int64, device))
    return logits.index_put(index, torch.full((len(row_idx),), float("-inf"), device=device))


def apply_penalties(
    logits: torch.Tensor, rows: Sequence[SamplingRow], pending: torch.Tensor | None = None
) -> torch.Tensor:
    """Repetition penalty (HF: tokens of prompt and output; positive logits divided, negative
    multiplied), then frequency and presence penalties (OpenAI: output tokens only;
    ``logit -= frequency * count + presence * (count > 0)``), on the rows that have any.

    An output list may end with a placeholder (-1: a token sampled on the device, not read back
    yet); ``pending`` then holds that token's id for the row (see :class:`Sampler`)."""
    rows_idx = [i for i, row in enumerate(rows) if row.sampling_params.needs_penalties]
    if not rows_idx:
        return logits
    params = [rows[i].sampling_params for i in rows_idx]
    device = logits.device
    index = None if len(rows_idx) == len(rows) else _tensor(rows_idx, torch.int64, device)
    selected = logits if index is None else logits[index]
    vocab_size = logits.shape[-1]

    output_counts = _token_counts([rows[i].output_token_ids for i in rows_idx], vocab_size, device)
    if pending is not None:  # + 1 at each row's pending token (rows without one add 0 at column 0)
        pending = pending if index is None else pending[index]
        output_counts.scatter_add_(1, pending.clamp(min=0).unsqueeze(1), (pending >= 0).float().unsqueeze(1))
    in_output = output_counts > 0

    if any(p.repetition_penalty != 1.0 for p in params):
        in_prompt = _token_counts([rows[i].prompt_token_ids for i in rows_idx], vocab_size, device) > 0
        penalty = _column([p.repetition_penalty for p in params], device)
        penalized = torch.where(selected > 0, selected / penalty, selected * penalty)
        selected = torch.where(in_prompt | in_output, penalized, selected)

    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        frequency = _column([p.frequency_penalty for p in params], device)
        presence = _column([p.presence_penalty for p in params], device)
        selected = selected - frequency * output_counts - presence * in_output

    if index is None:
        return selected
    return logits.index_put((index,), selected)


def apply_temperature(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Divide by each row's temperature; greedy rows (temperature ~ 0) are left as they are."""
    temperatures = [1.0 if p.is_greedy else p.temperature for p in params]
    if all(t == 1.0 for t in temperatures):
        return logits
    return logits / _column(temperatures, logits.device)


def apply_min_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p`` times the row's top probability."""
    if all(p.min_p == 0.0 for p in params):
        return logits
    probs = logits.softmax(dim=-1)
    threshold = _column([p.min_p for p in params], logits.device) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Mask tokens outside each row's top_k, then outside its top_p nucleus (one sort for both).

    Sorted ascending, so the most likely tokens are at the right end:

        sorted logits   [ -3.1  -2.0  -0.5   0.7   1.9 ]    top_k = 2: threshold = sorted[V - 2]
        cumulative p    [ 0.01  0.04  0.16  0.45  1.00 ]    top_p = 0.8: drop while cum <= 1 - 0.8

    Ties with the k-th logit are kept, and the last (most likely) token always survives, as in
    transformers' TopK/TopPLogitsWarper; top_p applies to the distribution left by top_k.
    """
    vocab_size = logits.shape[-1]
    use_top_k = any(0 < p.top_k < vocab_size for p in params)
    use_top_p = any(p.top_p < 1.0 for p in params)
    if not (use_top_k or use_top_p):
        return logits
    device = logits.device
    sorted_logits, sorted_idx = logits.sort(dim=-1)
    if use_top_k:
        k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        kth_position = _tensor([vocab_size - top_k for top_k in k], torch.int64, device).unsqueeze(1)
        kth_logit = sorted_logits.gather(1, kth_position)
        sorted_logits.masked_fill_(sorted_logits < kth_logit, float("-inf"))
    if use_top_p:
        # 1 - top_p in float64 before the cast, as transformers compares against it.
        max_dropped_mass = _column([1.0 - p.top_p for p in params], device)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= max_dropped_mass
        drop[:, -1] = False
        sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def exponential_race(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row of ``probs`` [R, V]: argmax(p / q) with q ~ Exp(1) picks i with
    probability p_i (the smallest of independent Exp(p_i) variables q_i / p_i).

    A row with a generator draws its own q from it, so a seeded request gets the same tokens
    whatever its batch and row index; the other rows share one draw from the global RNG.
    """
    q = torch.empty_like(probs)
    seeded = [i for i, generator in enumerate(generators) if generator is not None]
    if len(seeded) < len(generators):
        q.exponential_()  # one draw for the unseeded rows (seeded rows are overwritten below)
    for i in seeded:
        q[i].exponential_(generator=generators[i])
    # tiny keeps q > 0 (0 / 0 would be NaN, which argmax picks); p / tiny stays finite.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return (probs / q).argmax(dim=-1)


def _token_counts(token_lists: list[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab_size] float32: how often each token occurs in each list.
    Negative ids (placeholders of tokens still on the device) are not counted.

    The flat indices (row * vocab_size + token) are built on the host with numpy, which reads
    Python ints about five times faster than torch.tensor(list), and cross in one copy.
    """
    counts = torch.zeros(len(token_lists), vocab_size, dtype=torch.float32, device=device)
    lengths = [len(tokens) for tokens in token_lists]
    num_tokens = sum(lengths)
    if num_tokens == 0:
        return counts
    token_ids = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64, count=num_tokens)
    rows = np.repeat(np.arange(len(token_lists), dtype=np.int64) * vocab_size, lengths)
    keep = token_ids >= 0
    flat_index = to_device(torch.from_numpy(token_ids[keep] + rows[keep]), device)
    counts.view(-1).scatter_add_(0, flat_index, torch.ones(flat_index.shape[0], dtype=counts.dtype, device=device))
    return counts


def _tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=dtype), device)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return _tensor(values, torch.float32, device).unsqueeze(1)
