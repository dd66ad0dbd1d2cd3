"""draft_int8_kernel: whether an int8 draft model's W8A8 linears load onto sparsever's int8_linear
(verification/lossless/linear_kernel.py)."""

import contextlib

import pytest

import vllm_sparsever.compat.linear as compat_linear
from vllm_sparsever.verification.lossless import linear_kernel


@pytest.fixture
def taken(monkeypatch):
    """What each int8_draft_linears context hands compat (empty: it installed nothing); two layers
    "load" inside it."""
    seen = {}

    @contextlib.contextmanager
    def on_rows(run, max_tokens=None):
        seen["run"], seen["max_tokens"] = run, max_tokens
        yield ["layer a", "layer b"]

    monkeypatch.setattr(compat_linear, "int8_linears_on_rows", on_rows)
    return seen


def test_sparsever_puts_the_layers_on_the_op_and_counts_them(taken):
    counts = {}
    with linear_kernel.int8_draft_linears("sparsever", counts):
        assert taken["run"] is linear_kernel.ops.int8_linear and taken["max_tokens"] is None
    assert counts == {"draft model int8": 2}


def test_hybrid_puts_one_token_calls_on_the_op(taken):
    counts = {}
    with linear_kernel.int8_draft_linears("hybrid", counts):
        assert taken["run"] is linear_kernel.ops.int8_linear
        assert taken["max_tokens"] == linear_kernel.INT8_HYBRID_MAX_TOKENS == 1
    assert counts == {"draft model int8": 2}


@pytest.mark.parametrize("choice", ["auto", "vllm"])
def test_auto_and_vllm_keep_vllms_int8_gemm(taken, choice):
    """"auto" is vLLM's until the op is measured faster than oneDNN's int8 GEMM for a whole draft (on a
    Zen 4 it is slower at 2+ tokens)."""
    counts = {}
    with linear_kernel.int8_draft_linears(choice, counts):
        pass
    assert not taken and counts == {}


@pytest.mark.parametrize("choice", ["sparsever", "hybrid"])
def test_cpu_only_choices_off_cpu_are_refused_by_name(monkeypatch, choice):
    monkeypatch.setattr(linear_kernel, "is_cpu_platform", lambda: False)
    with pytest.raises(RuntimeError, match=rf"draft_int8_kernel: '{choice}' runs on CPU only"):
        linear_kernel.check_draft_int8_kernel(choice)
    linear_kernel.check_draft_int8_kernel("auto")
