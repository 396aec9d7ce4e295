"""The gated-delta-net kernels against the torch references in ``framework.ops_linear_attention``:
a step mixing decodes, a fresh one-token prompt, prefill chunks that resume a state (one shorter
than the conv's kernel) and a fresh one; a step of prompts spanning several 64-token chunks of
the chunked kernel; interpreted on CPU (fp32, bf16), compiled for sm_90, on CUDA."""

from __future__ import annotations

import pytest
import torch

from framework import ops_linear_attention as reference
from framework.testing import HopperCompile, compile_for_hopper, interpreted, require_triton

require_triton()

from fw_triton_ops.gated_delta_net import causal_conv1d, gated_delta_rule  # noqa: E402

HK, HV, DK, DV = 2, 4, 16, 24  # DV of 24: a masked v block
#: a decode resuming slot 3, a fresh one-token prompt in slot 0, a 21-token prefill chunk resuming
#: slot 4 (two token blocks of the conv), two more decodes (slots 1, 5), a 2-token chunk resuming
#: slot 6 (shorter than kernel - 1), a fresh 5-token prompt in slot 7; slot 2 is held by nobody
LENGTHS = [1, 1, 21, 1, 1, 2, 5]
SLOTS = [3, 0, 4, 1, 5, 6, 7]
RESUMES = [True, False, True, True, True, True, False]
#: the chunked prefill: 70 tokens resuming slot 3 (a chunk and 6), a fresh one-token prompt, a
#: fresh 130-token prompt (two chunks and 2), exactly one chunk resuming slot 1, then a decode
CHUNKED = dict(lengths=[70, 1, 130, 64, 1], slots=[3, 0, 4, 1, 5], resumes=[True, False, False, True, True])


def _step(device: str, dtype: torch.dtype, lengths: list[int] = LENGTHS):
    generator = torch.Generator().manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=dtype)

    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    tokens = cu[-1]
    q, k, v = randn(tokens, HK, DK), randn(tokens, HK, DK), randn(tokens, HV, DV)
    g = -2 * torch.rand(tokens, HV, generator=generator).to(device)
    beta = torch.rand(tokens, HV, generator=generator).to(device=device, dtype=dtype)
    states = torch.randn(8, HV, DK, DV, generator=generator).to(device)
    channels, kernel = 2 * HK * DK + HV * DV, 4
    x, weight = randn(tokens, channels), randn(channels, kernel, scale=0.5)
    conv_states = randn(8, channels, kernel - 1)
    return cu, (q, k, v, g, beta, states), (x, weight, conv_states)


def _check(device: str, dtype: torch.dtype, tol: dict, lengths=LENGTHS, slots=SLOTS, resumes=RESUMES) -> None:
    cu, (q, k, v, g, beta, states), (x, weight, conv_states) = _step(device, dtype, lengths)
    expected_states, expected_conv = states.clone(), conv_states.clone()
    indices = reference.StateIndices.build(cu, slots, resumes, torch.device(device))
    out = gated_delta_rule(q, k, v, g, beta, states, indices)
    expected = reference.gated_delta_rule(q, k, v, g, beta, expected_states, indices)
    torch.testing.assert_close(out, expected, **tol)
    torch.testing.assert_close(states, expected_states, **tol)
    conv = causal_conv1d(x, weight, conv_states, indices)
    torch.testing.assert_close(conv, reference.causal_conv1d(x, weight, expected_conv, indices), **tol)
    torch.testing.assert_close(conv_states, expected_conv, rtol=0, atol=0)  # the shift is exact


@interpreted
def test_kernels_match_the_references_in_a_mixed_step_fp32():
    _check("cpu", torch.float32, {"rtol": 1e-5, "atol": 1e-5})


@interpreted
@pytest.mark.parametrize(
    "dtype, tol",
    [(torch.float32, {"rtol": 1e-5, "atol": 1e-5}), (torch.bfloat16, {"rtol": 2e-2, "atol": 2e-2})],
    ids=["fp32", "bf16"],
)
def test_chunked_prefill_matches_the_reference_across_chunk_boundaries(dtype, tol):
    _check("cpu", dtype, tol, **CHUNKED)


def test_kernels_compile_for_hopper():
    indices = {name: "*i64" for name in ("rows_ptr", "slots_ptr", "resume_ptr")}
    conv = {name: "*bf16" for name in ("x_ptr", "weight_ptr", "bias_ptr", "states_ptr", "out_ptr")}
    # the Qwen3.5-27B layer: 16 key heads, 48 value heads, 128 x 128 states
    chunk = dict(
        HEADS_PER_KEY=3, NUM_V_HEADS=48, K_DIM=128, V_DIM=128, CHUNK=64, BLOCK_K=128, USE_QK_L2NORM=True,
        DOT_PRECISION="tf32",
    )  # fmt: skip
    cases = [
        HopperCompile(
            "fw_triton_ops.gated_delta_net:_recurrent_kernel",
            {
                **{name: "*bf16" for name in ("q_ptr", "k_ptr", "v_ptr", "beta_ptr", "out_ptr")},
                "g_ptr": "*fp32",
                "states_ptr": "*fp32",
                **{name: "*i64" for name in ("starts_ptr", "ends_ptr", "slots_ptr", "resume_ptr")},
            },
            dict(HEADS_PER_KEY=3, NUM_V_HEADS=48, K_DIM=128, V_DIM=128, BLOCK_K=128, BLOCK_V=32, USE_QK_L2NORM=True),
            float_args=("scale",),
            options=dict(num_warps=4),
        ),
        HopperCompile(
            "fw_triton_ops.gated_delta_chunk:_chunk_prepare_kernel",
            {
                **{name: "*bf16" for name in ("q_ptr", "k_ptr", "v_ptr", "beta_ptr")},
                **{name: "*fp32" for name in ("g_ptr", "gcum_ptr", "w_ptr", "u_ptr", "aqk_ptr")},
                "table_ptr": "*i64",
            },
            dict(chunk, BLOCK_DV=128),
            float_args=("scale",),
            options=dict(num_warps=4),
            divisible_by_16=("q_ptr", "k_ptr", "v_ptr", "beta_ptr", "gcum_ptr", "w_ptr", "u_ptr", "aqk_ptr")
            + ("stride_q", "stride_k", "stride_v"),
        ),
        HopperCompile(
            "fw_triton_ops.gated_delta_chunk:_chunk_state_kernel",
            {
                **{name: "*bf16" for name in ("q_ptr", "k_ptr", "out_ptr")},
                **{name: "*fp32" for name in ("gcum_ptr", "w_ptr", "u_ptr", "aqk_ptr", "states_ptr")},
                "table_ptr": "*i64",
            },
            dict(chunk, BLOCK_V=32),
            float_args=("scale",),
            options=dict(num_warps=4, num_stages=2),
            # as launched: aligned rows let Triton pipeline the chunk loop's loads through shared memory
            divisible_by_16=("q_ptr", "k_ptr", "out_ptr", "gcum_ptr", "w_ptr", "u_ptr", "aqk_ptr", "states_ptr")
            + ("stride_q", "stride_k", "stride_o"),
        ),
        HopperCompile(
            "fw_triton_ops.gated_delta_net:_conv_step_kernel",
            {**conv, **indices},
            dict(CHANNELS=10240, KERNEL=4, HAS_BIAS=False, BLOCK_D=256),
            options=dict(num_warps=4),
        ),
        HopperCompile(
            "fw_triton_ops.gated_delta_net:_conv_chunk_kernel",
            {**conv, "table_ptr": "*i64"},
            dict(CHANNELS=10240, KERNEL=4, HAS_BIAS=False, BLOCK_T=16, BLOCK_D=64),
            options=dict(num_warps=4),
        ),
        HopperCompile(
            "fw_triton_ops.gated_delta_net:_conv_state_kernel",
            {"x_ptr": "*bf16", "states_ptr": "*bf16", "table_ptr": "*i64"},
            dict(CHANNELS=10240, KERNEL=4, BLOCK_C=4, BLOCK_D=256),
            options=dict(num_warps=4),
        ),
    ]
    assert all(".target sm_90" in ptx for ptx in compile_for_hopper(cases))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype, tol",
    [(torch.float32, {"rtol": 1e-4, "atol": 1e-4}), (torch.bfloat16, {"rtol": 2e-2, "atol": 2e-2})],
    ids=["fp32", "bf16"],
)
def test_compiled_kernels_match_the_references_on_cuda(dtype, tol):
    _check("cuda", dtype, tol)
    _check("cuda", dtype, tol, **CHUNKED)
