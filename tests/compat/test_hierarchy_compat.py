"""vLLM internals hierarchical verification relies on: vLLM's n-gram matcher and the n-gram
drafter's bounds (compat.ngram), a request's committed tokens and its stop conditions in the
runner's state (compat.runner), and the model's final norm (the decoder stack's own contract
test, run_all/run_from included, is in test_self_draft_compat)."""

import inspect
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_sparsever.compat import ngram as compat_ngram
from vllm_sparsever.compat import runner as compat_runner
from vllm_sparsever.integration.step_inputs import draft_step


def test_ngram_matcher_proposes_what_followed_the_longest_match():
    # In a subprocess: numba's llvmlite, once imported, trips vLLM's Triton-override module scan
    # (vllm/triton_utils/dispatcher.py) that test_self_draft_compat runs in this process.
    code = """
import numpy as np
from vllm_sparsever.compat.ngram import match_ngram
tokens = np.array([5, 1, 2, 3, 9, 8, 4, 2, 3, 7, 6, 1, 2, 3], dtype=np.int32)
# Suffix [1, 2, 3] matched at the start (longest); what followed it: 9, 8.
assert match_ngram(tokens, 1, 3, 1024, 2) == [9, 8]
assert match_ngram(np.array([1, 2, 3, 4], dtype=np.int32), 2, 3, 1024, 2) == []
# Never past max_model_len.
assert match_ngram(tokens, 1, 3, len(tokens) + 1, 5) == [9]
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_ngram_proposer_keeps_its_bounds():
    import importlib.util
    from pathlib import Path

    # Read, not imported: see the test above (numba).
    source = Path(importlib.util.find_spec("vllm.v1.spec_decode.ngram_proposer").origin).read_text()
    assert "self.min_n = " in source and "self.max_n = " in source
    assert "def _find_longest_matched_ngram_and_propose_tokens(" in source
    assert compat_ngram.ngram_bounds(SimpleNamespace(drafter=SimpleNamespace(min_n=2, max_n=4))) == (2, 4)


def test_draft_step_histories_and_request_limits_of_a_real_input_batch():
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

    batch = InputBatch(max_num_reqs=4, max_model_len=256, max_num_batched_tokens=64, device=torch.device("cpu"),
                       vocab_size=100, block_sizes=[32], max_num_blocks_per_req=[8])
    params = [SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[7]),
              SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True, stop_token_ids=[3])]
    params[0].update_from_generation_config({}, eos_token_id=2)
    params[1].update_from_generation_config({}, eos_token_id=2)
    states = {}
    for i, (prompt, output) in enumerate([([11, 12, 13], [14, 15]), ([21, 22], [])]):
        states[f"r{i}"] = CachedRequestState(
            req_id=f"r{i}", prompt_token_ids=prompt, mm_features=[], sampling_params=params[i], generator=None,
            block_ids=([i],), num_computed_tokens=len(prompt), output_token_ids=output,
        )
        batch.add_request(states[f"r{i}"])
    runner = SimpleNamespace(input_batch=batch, requests=states, model_config=SimpleNamespace(max_model_len=256))
    step = draft_step(runner, [[15], []], lookahead=3, depth=3)
    assert step.req_ids == ["r0", "r1"] and step.sampled == [[15], []]
    assert step.history(0).tolist() == [11, 12, 13, 14, 15]
    assert step.history(1).tolist() == [21, 22]
    assert compat_runner.allocated_slots(runner).tolist() == [32, 32]  # one block each
    assert step.budgets.tolist() == [3, 0] and step.slot_limited == 0  # r1 sampled nothing
    # Where each row's scheduled tokens start and what they are (the target states an EAGLE head reads).
    assert compat_runner.step_token_layout(runner, np.array([2, 0])) == [("r0", 3, [14, 15]), ("r1", 2, [])]
    first, second = step.limits_of([0, 1])
    assert first.stop_token_ids == {7, 2} and first.remaining_tokens == 8  # 2 of 10 emitted
    assert second.stop_token_ids == {3} and second.remaining_tokens is None  # ignore_eos: no EOS


def test_vllm_model_forward_ends_with_the_fused_final_norm():
    from vllm.model_executor.models import llama, qwen2

    for model in (llama.LlamaModel, qwen2.Qwen2Model):
        assert "hidden_states, _ = self.norm(hidden_states, residual)" in inspect.getsource(model.forward)


def test_step_drafts_set_after_bookkeeping_are_what_the_scheduler_takes():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    fake = SimpleNamespace(num_spec_tokens=3, input_batch=SimpleNamespace(req_ids=["a", "b"]),
                           _draft_token_ids=None, _draft_token_req_ids=None)
    fake._get_draft_token_ids_cpu = lambda: GPUModelRunner._get_draft_token_ids_cpu(fake)
    compat_runner.set_draft_token_ids(fake, [[5, 6], []])
    taken = GPUModelRunner.take_draft_token_ids(fake)
    assert taken.req_ids == ["a", "b"] and taken.draft_token_ids == [[5, 6], []]


def test_draft_model_and_scheduled_tokens():
    import importlib.util
    from pathlib import Path

    source = Path(importlib.util.find_spec("vllm.v1.spec_decode.llm_base_proposer").origin).read_text()
    assert "self.model = " in source  # the proposer keeps its loaded draft model here
    model = object()
    assert compat_runner.draft_model(SimpleNamespace(drafter=SimpleNamespace(model=model))) is model
    with pytest.raises(ValueError, match="no loaded draft model"):
        compat_runner.draft_model(SimpleNamespace(drafter=None))
    # vLLM writes the scheduled drafts after the committed tokens in token_ids_cpu.
    from vllm.v1.worker.gpu_input_batch import InputBatch

    assert "self.token_ids_cpu[req_index, start_index:end_token_index] = spec_token_ids" in \
        inspect.getsource(InputBatch)
    runner = SimpleNamespace(input_batch=SimpleNamespace(token_ids_cpu=np.arange(20).reshape(2, 10)))
    assert compat_runner.scheduled_token_ids(runner, 1, 3, 4) == [13, 14, 15, 16]
