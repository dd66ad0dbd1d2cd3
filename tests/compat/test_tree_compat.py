"""The vLLM symbols tree verification reads (compat.runner: sampling inputs/outputs, KV caches)."""

import inspect
from types import SimpleNamespace

import pytest
import torch

from vllm_sparsever.compat import runner as compat_runner
from vllm_sparsever.compat import worker as compat_worker


def test_sample_hook_takes_logits_and_spec_decode_metadata():
    _, cpu_runner = compat_worker.cpu_worker_classes()
    params = list(inspect.signature(cpu_runner._sample).parameters)
    assert params[1:3] == ["logits", "spec_decode_metadata"]
    logits, meta = compat_runner.sample_call_args((1, 2), {})
    assert (logits, meta) == (1, 2)
    assert compat_runner.sample_call_args((), {"logits": 3, "spec_decode_metadata": 4}) == (3, 4)


def test_spec_decode_metadata_rows_are_drafts_plus_one_per_request():
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    meta = SpecDecodeMetadata.make_dummy([[5, 6], [], [7]], device=torch.device("cpu"))
    assert compat_runner.logits_row_ends(meta) == [3, 4, 6]


def test_sampling_metadata_fields_and_greedy_marker():
    import dataclasses

    from vllm.v1.sample.metadata import SamplingMetadata

    fields = {f.name for f in dataclasses.fields(SamplingMetadata)}
    assert {"temperature", "all_greedy", "top_k", "top_p", "generators"} <= fields
    gen = torch.Generator()
    sm = SimpleNamespace(all_greedy=False, temperature=torch.tensor([0.0, 0.7]), top_k=None,
                         top_p=torch.tensor([1.0, 0.9]), generators={1: gen})
    runner = SimpleNamespace(input_batch=SimpleNamespace(sampling_metadata=sm))
    greedy, sampled = compat_runner.row_sampling(runner, 0), compat_runner.row_sampling(runner, 1)
    assert greedy.temperature is None
    assert sampled.temperature == pytest.approx(0.7) and sampled.generator is gen
    assert sampled.top_k is None and sampled.top_p.tolist() == pytest.approx([0.9])
    # vLLM's input batch writes temperature 0.0 for greedy requests (what row_sampling reads).
    src = inspect.getsource(__import__("vllm.v1.worker.gpu_input_batch", fromlist=["x"]))
    assert "self.temperature_cpu[req_index] = 0.0" in src


def test_sampler_output_rows_and_placeholder():
    from vllm.v1.outputs import SamplerOutput
    from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler

    assert PLACEHOLDER_TOKEN_ID == -1
    out = SamplerOutput(sampled_token_ids=torch.full((2, 4), 9, dtype=torch.int32), logprobs_tensors=None)
    compat_runner.write_sampled_tokens(out, 1, [3, 4])
    assert out.sampled_token_ids.tolist() == [[9, 9, 9, 9], [3, 4, -1, -1]]
    parsed, _ = RejectionSampler.parse_output(out.sampled_token_ids, 100)
    assert parsed[1] == [3, 4]


def test_sampler_only_params_exist_with_their_defaults():
    from vllm import SamplingParams

    params = SamplingParams()
    for name, default in compat_runner.SAMPLER_ONLY_PARAMS.items():
        assert hasattr(params, name), name
        value = getattr(params, name)
        assert value is None or value == default or value == [], (name, value)
    runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=["a", "b"]),
                             requests={"a": SimpleNamespace(sampling_params=SamplingParams(temperature=0.5, top_p=0.9)),
                                       "b": SimpleNamespace(sampling_params=SamplingParams(presence_penalty=0.5))})
    assert compat_runner.tree_sampling_supported(runner, 0)
    assert not compat_runner.tree_sampling_supported(runner, 1)


def test_seeded_sampling_is_vllms_random_seed_type():
    from vllm import SamplingParams

    params = {"seeded": SamplingParams(temperature=0.8, seed=3), "unseeded": SamplingParams(temperature=0.8),
              "greedy_with_seed": SamplingParams(temperature=0.0, seed=3)}
    runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=list(params)),
                             requests={k: SimpleNamespace(sampling_params=v) for k, v in params.items()})
    assert [compat_runner.seeded_sampling(runner, row) for row in range(3)] == [True, False, False]


def test_processed_target_probs_matches_vllms_top_k_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    probs = compat_runner.processed_target_probs(logits, 0.5, torch.tensor([2]), None)
    want = torch.softmax(torch.tensor([[4.0, 2.0, float("-inf"), float("-inf")]]), -1)
    assert torch.allclose(probs, want)


def test_attention_layer_kv_cache_binding():
    """`layer_kv_caches` reads `Attention.kv_cache`, which vLLM binds at KV cache set-up."""
    from vllm.model_executor.layers.attention.attention import Attention

    src = inspect.getsource(Attention)
    assert "self.kv_cache" in src
    assert "kv_positions" in inspect.signature(compat_runner.query_attention_context).parameters


def test_tp_broadcast_object_signature():
    from vllm.distributed.parallel_state import GroupCoordinator

    params = inspect.signature(GroupCoordinator.broadcast_object).parameters
    assert list(params)[1:3] == ["obj", "src"]


def test_emitted_count_counts_non_placeholder_tokens():
    out = SimpleNamespace(sampled_token_ids=torch.tensor([[5, 6, -1, -1], [7, -1, -1, -1]], dtype=torch.int32))
    assert compat_runner.emitted_count(out, 0) == 2 and compat_runner.emitted_count(out, 1) == 1
