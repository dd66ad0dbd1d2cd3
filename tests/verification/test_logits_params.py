"""min_p and logit_bias on verification logits (verification/lossless/logits_params.py) against vLLM's own
logits processors (`MinPLogitsProcessor`, `LogitBiasLogitsProcessor`) applied to one request's
rows, as vLLM's sampler applies them without speculation."""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_sparsever.verification.lossless.logits_params import apply_logit_bias, apply_min_p, needs_logits_params

VOCAB = 50


def _vllm_processor(kind: str, params, rows: int):
    """vLLM's builtin processor with `rows` copies of one request (`params`) in its batch."""
    from vllm.v1.sample.logits_processor import LogitBiasLogitsProcessor, MinPLogitsProcessor
    from vllm.v1.sample.logits_processor.interface import BatchUpdate

    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=rows))
    cls = MinPLogitsProcessor if kind == "min_p" else LogitBiasLogitsProcessor
    proc = cls(config, torch.device("cpu"), False)
    proc.update_state(BatchUpdate(batch_size=rows, removed=[], moved=[],
                                  added=[(i, params, None, []) for i in range(rows)]))
    return proc


def _params(temperature=1.0, min_p=0.0, logit_bias=None):
    return SimpleNamespace(temperature=temperature, min_p=min_p, logit_bias=logit_bias)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), temperature=st.floats(0.1, 3.0), min_p=st.floats(0.01, 1.0),
       counts=st.lists(st.integers(0, 4), min_size=1, max_size=4))
def test_min_p_matches_vllms_processor_per_request(seed, temperature, min_p, counts):
    logits = torch.randn(sum(counts), VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    params = [_params(temperature, min_p) if i % 2 == 0 else _params(temperature) for i in range(len(counts))]
    got = apply_min_p(logits.clone(), counts, params)
    start = 0
    for n, p in zip(counts, params):
        rows = logits[start:start + n]
        want = rows.clone()
        if n and p.min_p:
            # vLLM: temperature, then min_p (an -inf mask the later division keeps).
            masked = _vllm_processor("min_p", p, n).apply(rows.clone() / temperature)
            want = torch.where(torch.isinf(masked), masked, rows)
        torch.testing.assert_close(got[start:start + n], want, rtol=0, atol=0)
        start += n


def test_min_p_one_keeps_only_the_argmax():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0))
    out = apply_min_p(logits.clone(), [6], [_params(0.7, 1.0)])
    assert torch.equal(torch.isfinite(out).sum(-1), torch.ones(6, dtype=torch.long))
    assert torch.equal(out.argmax(-1), logits.argmax(-1))


def test_greedy_requests_get_no_min_p_mask():
    logits = torch.randn(3, VOCAB)
    out = apply_min_p(logits.clone(), [3], [_params(0.0, 0.5)])
    assert torch.equal(out, logits) and not needs_logits_params(_params(0.0, 0.5))


def test_logit_bias_matches_vllms_processor_and_only_its_rows():
    logits = torch.randn(7, VOCAB, generator=torch.Generator().manual_seed(1))
    bias = {3: 5.0, 17: -2.5, 49: 0.25}
    params = [_params(), _params(logit_bias=bias), None]
    got = apply_logit_bias(logits.clone(), [2, 3, 2], params)
    want = logits.clone()
    want[2:5] = _vllm_processor("logit_bias", params[1], 3).apply(logits[2:5].clone())
    assert torch.equal(got, want) and not torch.equal(got[2:5], logits[2:5])
    assert torch.equal(got[:2], logits[:2]) and torch.equal(got[5:], logits[5:])


def test_mismatched_batch_is_a_programming_error():
    with pytest.raises(ValueError, match="sampling params"):
        apply_logit_bias(torch.zeros(2, VOCAB), [1, 1], [_params()])
