"""draft_int8_kernel: whether an int8 draft model's W8A8 linears load onto sparsever's int8_linear
(verification/lossless/linear_kernel.py)."""

import contextlib

import pytest

import vllm_sparsever.compat.linear as compat_linear
from vllm_sparsever.verification.lossless import linear_kernel


@pytest.fixture
def taken(monkeypatch):
    """The `take` each int8_draft_linears context hands compat (none: it installed nothing)."""
    seen = {}

    @contextlib.contextmanager
    def on_rows(run, take):
        seen["take"] = take
        yield

    monkeypatch.setattr(compat_linear, "int8_linears_on_rows", on_rows)
    return seen


def test_sparsever_takes_every_layer_and_counts_them(taken):
    counts = {}
    with linear_kernel.int8_draft_linears("sparsever", counts):
        assert taken["take"](None, 7, 64) and taken["take"](None, 8, 64)
    assert counts == {"draft model int8": 2}


@pytest.mark.parametrize("choice", ["auto", "vllm"])
def test_auto_and_vllm_keep_vllms_int8_gemm(taken, choice):
    """"auto" is vLLM's until the op is measured faster than oneDNN's int8 GEMM (it is slower on a Zen 4)."""
    counts = {}
    with linear_kernel.int8_draft_linears(choice, counts):
        pass
    assert not taken and counts == {}


def test_sparsever_off_cpu_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(linear_kernel, "is_cpu_platform", lambda: False)
    with pytest.raises(RuntimeError, match=r"draft_int8_kernel: 'sparsever' runs on CPU only"):
        linear_kernel.check_draft_int8_kernel("sparsever")
    linear_kernel.check_draft_int8_kernel("auto")
