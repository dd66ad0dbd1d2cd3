"""draft_int4_kernel: whether an int4 draft model's linears load onto sparsever's int4_linear
(verification/lossless/linear_kernel.py)."""

import contextlib

import pytest
import torch

import vllm_sparsever.compat.linear as compat_linear
from vllm_sparsever.verification.lossless import linear_kernel


@pytest.fixture
def taken(monkeypatch):
    """What each int4_draft_linears context hands compat (empty: it installed nothing); two layers
    "load" inside it."""
    seen = {}

    @contextlib.contextmanager
    def on_rows(run, pack, max_tokens=None):
        seen["run"], seen["pack"], seen["max_tokens"] = run, pack, max_tokens
        yield ["layer a", "layer b"]

    monkeypatch.setattr(compat_linear, "int4_linears_on_rows", on_rows)
    return seen


@pytest.mark.parametrize("choice, max_tokens", [("sparsever", None), ("hybrid", 32)])
def test_the_op_takes_the_layers_for_every_call_or_calls_of_up_to_32_tokens(taken, choice, max_tokens):
    counts = {}
    with linear_kernel.int4_draft_linears(choice, counts):
        assert taken["run"] is linear_kernel.ops.int4_linear and taken["pack"] is linear_kernel.ops.pack_int4_rows
        assert taken["max_tokens"] == max_tokens
    assert max_tokens is None or max_tokens == linear_kernel.INT4_HYBRID_MAX_TOKENS
    assert counts == {"draft model int4": 2}


def test_vllm_keeps_vllms_int4_gemm(taken):
    counts = {}
    with linear_kernel.int4_draft_linears("vllm", counts):
        pass
    assert not taken and counts == {}


@pytest.mark.parametrize("amx", [False, True])
def test_auto_is_hybrid_on_vnni_cpus_without_amx(monkeypatch, amx):
    """"auto" resolves to "hybrid" for a quantized draft on a VNNI CPU without AMX tiles (where
    vLLM-CPU's int4 GEMM is W4A16), else "vllm"; explicit choices stay as given."""
    monkeypatch.setattr(linear_kernel, "is_cpu_platform", lambda: True)
    monkeypatch.setattr(linear_kernel.ops, "int8_vnni_available", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    resolve = linear_kernel.resolve_draft_int4_kernel
    assert resolve("auto", True) == ("vllm" if amx else "hybrid")
    assert resolve("auto", False) == "vllm"
    assert resolve("sparsever", True) == "sparsever" and resolve("vllm", True) == "vllm"
    monkeypatch.setattr(linear_kernel.ops, "int8_vnni_available", lambda: False)
    assert resolve("auto", True) == "vllm"


@pytest.mark.parametrize("choice", ["sparsever", "hybrid"])
def test_cpu_only_choices_off_cpu_are_refused_by_name(monkeypatch, choice):
    monkeypatch.setattr(linear_kernel, "is_cpu_platform", lambda: False)
    with pytest.raises(RuntimeError, match=rf"draft_int4_kernel: '{choice}' runs on CPU only"):
        linear_kernel.check_draft_int4_kernel(choice)
    linear_kernel.check_draft_int4_kernel("auto")
