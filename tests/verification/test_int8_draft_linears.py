"""draft_int8_kernel: whether an int8 draft model's W8A8 linears load onto sparsever's int8_linear
(verification/lossless/linear_kernel.py)."""

import contextlib

import pytest
import torch

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


def test_hybrid_puts_calls_of_few_tokens_on_the_op(taken):
    counts = {}
    with linear_kernel.int8_draft_linears("hybrid", counts):
        assert taken["run"] is linear_kernel.ops.int8_linear
        assert taken["max_tokens"] == linear_kernel.INT8_HYBRID_MAX_TOKENS == 3
    assert counts == {"draft model int8": 2}


def test_vllm_keeps_vllms_int8_gemm(taken):
    counts = {}
    with linear_kernel.int8_draft_linears("vllm", counts):
        pass
    assert not taken and counts == {}


@pytest.mark.parametrize("pays", [True, False])
def test_auto_is_hybrid_where_the_one_token_op_is_measured_faster(monkeypatch, pays):
    """"auto" resolves to "hybrid" for a quantized draft on a VNNI CPU where the probe finds the op's
    one-token call faster than vLLM-CPU's int8 GEMM, else "vllm"; explicit choices stay as given; a
    16-bit draft or a CPU without VNNI is not probed."""
    probed = []
    monkeypatch.setattr(linear_kernel, "int8_rows_pay", lambda dtype: probed.append(dtype) or pays)
    monkeypatch.setattr(linear_kernel, "is_cpu_platform", lambda: True)
    monkeypatch.setattr(linear_kernel.ops, "int8_vnni_available", lambda: True)
    resolve = linear_kernel.resolve_draft_int8_kernel
    assert resolve("auto", torch.bfloat16, True) == ("hybrid" if pays else "vllm")
    assert probed == [torch.bfloat16]
    assert resolve("sparsever", torch.bfloat16, True) == "sparsever" and resolve("vllm", torch.bfloat16, True) == "vllm"
    assert resolve("auto", torch.bfloat16, False) == "vllm"
    monkeypatch.setattr(linear_kernel.ops, "int8_vnni_available", lambda: False)
    assert resolve("auto", torch.bfloat16, True) == "vllm"
    assert probed == [torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_probe_times_both_kernels_on_this_cpu(dtype, caplog):
    """int8_rows_pay runs both one-token calls here (about 0.3 s) and says what it measured."""
    linear_kernel.int8_rows_pay.cache_clear()
    with caplog.at_level("INFO", logger="vllm_sparsever"):
        decision = linear_kernel.int8_rows_pay(dtype)
    assert isinstance(decision, bool)
    assert "int8_linear" in caplog.text and "vLLM-CPU's" in caplog.text


@pytest.mark.parametrize("choice", ["sparsever", "hybrid"])
def test_cpu_only_choices_off_cpu_are_refused_by_name(monkeypatch, choice):
    monkeypatch.setattr(linear_kernel, "is_cpu_platform", lambda: False)
    with pytest.raises(RuntimeError, match=rf"draft_int8_kernel: '{choice}' runs on CPU only"):
        linear_kernel.check_draft_int8_kernel(choice)
    linear_kernel.check_draft_int8_kernel("auto")
