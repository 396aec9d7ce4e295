"""``prefetch_to_l2``: the load kernel reads every byte it is asked for (CPU, interpreter); on the
GPU both methods run eagerly and inside a CUDA graph without a host sync and change nothing, and
an engine with ``FW_PREFETCH_WEIGHTS`` set generates the same greedy ids as one without."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from framework.testing import check_no_sync_and_cuda_graph_replay, interpreted

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install 'triton>=3.4'; the interpreter runs it on CPU)",
                allow_module_level=True)

from fw_triton_ops.prefetch import _load_to_l2_kernel, prefetch_to_l2  # noqa: E402


@interpreted
@pytest.mark.parametrize(("num_elements", "programs"), [(1000, 3), (64, 5), (4097, 1)])
def test_the_load_kernel_reads_each_element_once(num_elements, programs):
    x = torch.randn(num_elements, generator=torch.Generator().manual_seed(num_elements))
    sink = torch.zeros(programs)
    _load_to_l2_kernel[(programs,)](x, num_elements, sink, BLOCK=64)
    torch.testing.assert_close(sink.sum(), x.sum(), rtol=1e-5, atol=1e-4)


def test_a_bad_method_is_refused_and_cpu_tensors_are_left_alone():
    with pytest.raises(ValueError, match="prefetch method must be one of auto, load, bulk; got 'fast'"):
        prefetch_to_l2(torch.zeros(4), 16, "fast")
    prefetch_to_l2(torch.zeros(4), 16, "bulk")  # a hint with nothing to do on the CPU


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["bulk", "load", "auto"])
def test_prefetch_changes_nothing_never_syncs_and_replays_in_a_cuda_graph(method):
    weights = [torch.randn(3001, 1000, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    before = [w.clone() for w in weights]

    def prefetch(weight):
        prefetch_to_l2(weight, 2**22, method)
        return weight

    check_no_sync_and_cuda_graph_replay(prefetch, (weights[0],), lambda: (weights[1],))
    assert torch.equal(weights[0], before[1]) and torch.equal(weights[1], before[1])  # the check copied 1 into 0


@pytest.mark.gpu
@pytest.mark.parametrize("setting", ["bulk", "load:1"])
def test_an_engine_that_prefetches_weights_generates_the_same_greedy_ids(tmp_path, monkeypatch, setting):
    import transformers

    from framework import LLM, SamplingParams
    from framework.testing import count_kernel_calls, reference_greedy, write_tiny_model

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      initializer_range=0.1)
    reference = write_tiny_model(tmp_path, config)
    prompts = [[int(t) for t in torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(n))] for n in (5, 37)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    monkeypatch.setenv("FW_PREFETCH_WEIGHTS", setting)
    with count_kernel_calls() as calls:
        llm = LLM(str(tmp_path), device="cuda", dtype="f32", num_blocks=64)
        ids = [r.outputs[0].token_ids for r in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert llm.engine.summary["weight_prefetch"].startswith(setting.split(":")[0])
    assert llm.engine.summary["weight_prefetch"].endswith("(fw_triton_ops.prefetch)")
    assert "decode graphs" in llm.engine.summary["cuda_graphs"]
    # 2 layers x 4 linears: 7 prefetches in every forward after the first (graph captures included)
    assert calls["prefetch_to_l2/triton"] >= 7 * 2, calls
    assert ids == [reference_greedy(reference, p, steps=24) for p in prompts]
