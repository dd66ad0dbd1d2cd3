"""draft_int8_kernel: which of an int8 draft model's W8A8 linears load onto sparsever's int8_linear
(verification/lossless/linear_kernel.py), with vLLM's own choice of GEMM and the CPU's VNNI made up."""

import contextlib

import pytest

import vllm_sparsever.compat.linear as compat_linear
from vllm_sparsever.verification.lossless import linear_kernel


@pytest.fixture
def taken(monkeypatch):
    """The `take` each int8_draft_linears context hands compat (None: it installed nothing); vLLM
    would give 7-row layers sgl-kernel's AMX GEMM, others oneDNN's."""
    seen = {}

    @contextlib.contextmanager
    def on_rows(run, take):
        seen["take"] = take
        yield

    monkeypatch.setattr(compat_linear, "int8_linears_on_rows", on_rows)
    monkeypatch.setattr(compat_linear, "cpu_int8_gemm_is_sgl", lambda n, k: n == 7)
    return seen


@pytest.mark.parametrize("vnni", [True, False])
def test_auto_takes_the_layers_vllm_gives_onednn_on_vnni_cpus(taken, monkeypatch, vnni):
    monkeypatch.setattr(linear_kernel.ops, "int8_vnni_available", lambda: vnni)
    counts = {}
    with linear_kernel.int8_draft_linears("auto", counts):
        decisions = [taken["take"](None, n, 64) for n in (8, 7, 16)]
    assert decisions == ([True, False, True] if vnni else [False, False, False])
    assert counts == ({"draft model int8": 2} if vnni else {})


def test_sparsever_takes_every_layer_and_vllm_installs_nothing(taken, monkeypatch):
    monkeypatch.setattr(linear_kernel.ops, "int8_vnni_available", lambda: False)
    counts = {}
    with linear_kernel.int8_draft_linears("sparsever", counts):
        assert taken["take"](None, 7, 64) and taken["take"](None, 8, 64)
    assert counts == {"draft model int8": 2}
    taken.clear()
    with linear_kernel.int8_draft_linears("vllm", counts):
        pass
    assert not taken


def test_sparsever_off_cpu_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(linear_kernel, "is_cpu_platform", lambda: False)
    with pytest.raises(RuntimeError, match=r"draft_int8_kernel: 'sparsever' runs on CPU only"):
        linear_kernel.check_draft_int8_kernel("sparsever")
    linear_kernel.check_draft_int8_kernel("auto")
