"""Contracts of the vLLM symbols sparsever uses to honour min_p and logit_bias
(compat/sampling.py): the front end's spec-decode check and the rejection sampler's hook."""

import inspect
import pickle
from types import SimpleNamespace

import pytest
import torch

from vllm_sparsever.compat import sampling
from vllm_sparsever.verification.lossless.logits_params import apply_logit_bias, apply_min_p, needs_logits_params


def _speculative_config():
    from vllm.config import SpeculativeConfig

    # The front end's check only tests the config for None (and, wrapped, for sparsever's mark).
    return SpeculativeConfig.__new__(SpeculativeConfig)


@pytest.mark.parametrize("param", [{"min_p": 0.2, "temperature": 0.8}, {"logit_bias": {3: 1.0}}])
def test_front_end_refuses_for_vllm_methods_and_allows_for_sparsever(param):
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

    sampling.allow_min_p_and_logit_bias()
    assert sampling.allow_min_p_and_logit_bias() is False  # idempotent
    params = SamplingParams(**param)
    with pytest.raises(VLLMValidationError, match="not yet supported with speculative decoding"):
        params._validate_spec_decode(_speculative_config())  # a vLLM method: vLLM's refusal stands
    marked = _speculative_config()
    sampling.mark_sparsever_speculative_config(marked)
    params._validate_spec_decode(marked)
    params._validate_spec_decode(None)


def test_the_mark_survives_pickling():
    """API-server processes get the config pickled."""
    from vllm.config import SpeculativeConfig

    config = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_max=3, prompt_lookup_min=1)
    sampling.mark_sparsever_speculative_config(config)
    assert getattr(pickle.loads(pickle.dumps(config)), sampling._SPARSEVER_MARK, False)


def test_rejection_sampler_hook_has_the_assumed_signature():
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    assert list(inspect.signature(RejectionSampler.apply_logits_processors).parameters) == [
        "self", "logits", "sampling_metadata", "metadata"]
    assert "num_draft_tokens" in SpecDecodeMetadata.__dataclass_fields__
    # forward() calls it on the instance (so a per-instance wrapper takes effect)
    assert "self.apply_logits_processors" in inspect.getsource(RejectionSampler.forward)


def test_wrapper_biases_before_vllms_processors_and_masks_after():
    calls = []

    class FakeSampler:
        def apply_logits_processors(self, logits, sampling_metadata, metadata):
            calls.append(logits.clone())
            return logits

    fake = FakeSampler()
    params = [SimpleNamespace(temperature=1.0, min_p=1.0, logit_bias={0: 100.0})]
    wrap = (lambda: params, needs_logits_params, apply_logit_bias, apply_min_p)
    runner = SimpleNamespace(rejection_sampler=fake)
    assert sampling.wrap_draft_row_logits(runner, *wrap)
    assert sampling.wrap_draft_row_logits(runner, *wrap)  # idempotent: one wrapper
    assert not sampling.wrap_draft_row_logits(SimpleNamespace(rejection_sampler=None), *wrap)  # no spec decode
    out = fake.apply_logits_processors(torch.zeros(2, 8), None, SimpleNamespace(num_draft_tokens=[2]))
    assert len(calls) == 1 and torch.all(calls[0][:, 0] == 100.0)  # vLLM's processors saw the bias
    assert torch.all(torch.isfinite(out).sum(-1) == 1) and torch.all(out.argmax(-1) == 0)


def test_builtin_processors_are_left_out_under_spec_decode_and_added_back():
    """vLLM's `build_logitsprocs` drops min_p and logit bias when speculative decoding is on (the
    reason sparsever adds them); the runner keeps the batch's `LogitsProcessors` on re-init."""
    from vllm.v1.sample.logits_processor import (
        LogitBiasLogitsProcessor,
        LogitsProcessors,
        MinPLogitsProcessor,
        build_logitsprocs,
    )
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    config = SimpleNamespace(speculative_config=object(), scheduler_config=SimpleNamespace(max_num_seqs=4))
    procs = build_logitsprocs(config, torch.device("cpu"), False, False)
    assert not any(isinstance(p, (MinPLogitsProcessor, LogitBiasLogitsProcessor)) for p in procs.all)
    runner = SimpleNamespace(input_batch=SimpleNamespace(logitsprocs=procs), vllm_config=config,
                             device=torch.device("cpu"), pin_memory=False)
    assert sampling.add_min_p_and_logit_bias_processors(runner) == 2
    assert sampling.add_min_p_and_logit_bias_processors(runner) == 0
    assert any(isinstance(p, MinPLogitsProcessor) for p in procs.argmax_invariant)
    assert any(isinstance(p, LogitBiasLogitsProcessor) for p in procs.non_argmax_invariant)
    assert isinstance(procs, LogitsProcessors)
    assert "logitsprocs=self.input_batch.logitsprocs" in inspect.getsource(GPUModelRunner)
