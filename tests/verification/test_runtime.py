"""The runtime's knob resolution, run-time switch and fallback policy (no engine)."""

import pytest
import torch

from vllm_sparsever.config import SparseverConfig, SparseverConfigError
from vllm_sparsever.verification.sparse.profile import CalibrationProfile
from vllm_sparsever.verification.sparse.runtime import (
    STATS_SAMPLE_EVERY,
    SparsePathUnavailable,
    SparseVerificationRuntime,
)


def _config(**raw):
    return SparseverConfig.from_dict({"method": "sparsever", "model": "d", "num_speculative_tokens": 3, **raw})


def test_values_come_from_config_then_profile_then_defaults():
    profile = CalibrationProfile(model="m", num_layers=3, anchor_layers=[0, 2],
                                 ffn_keep_ratios=[0.3, None, 0.7])
    rt = SparseVerificationRuntime(_config(ffn=True, attention=True), profile, "test", 3)
    assert rt.anchor_layers() == [0, 2]
    assert rt.ffn_keep_ratio(0) == 0.3 and rt.ffn_keep_ratio(1) == 0.5  # None -> default
    rt.set_sections({"ffn": {"enabled": True, "keep_ratio": 0.9}, "attention": {"enabled": True, "anchor_layers": [0]}})
    assert rt.ffn_keep_ratio(0) == 0.9 and rt.anchor_layers() == [0]


def test_fallback_warns_and_counts_or_raises():
    rt = SparseVerificationRuntime(_config(ffn=True))
    rt.fallback("ffn", "boom")
    assert rt.stats_summary() == {"ffn_fallbacks": 1, "ffn_fallback_boom": 1}
    strict = SparseVerificationRuntime(_config(ffn=True, fallback_to_dense=False))
    with pytest.raises(RuntimeError, match="fallback_to_dense is false"):
        strict.fallback("ffn", "boom")


def _raise(exc):
    def sparse():
        raise exc
    return sparse


def test_run_time_problems_fall_back_counted_per_reason():
    rt = SparseVerificationRuntime(_config(ffn=True))
    assert rt.run_sparse("ffn", lambda: 42) == 42
    assert rt.run_sparse("ffn", _raise(SparsePathUnavailable("metadata_mismatch", "3 rows vs 4"))) is None
    assert rt.run_sparse("ffn", _raise(RuntimeError("kernel check failed"))) is None
    assert rt.run_sparse("ffn", _raise(torch.OutOfMemoryError("no memory"))) is None
    assert rt.stats_summary() == {"ffn_fallbacks": 3, "ffn_fallback_metadata_mismatch": 1,
                                  "ffn_fallback_kernel_error": 2}


@pytest.mark.parametrize("error", [TypeError("bad call"), AttributeError("no such field"), KeyError("x"),
                                   IndexError("i"), ValueError("v"), NotImplementedError("gap")])
def test_programming_errors_are_never_hidden_behind_a_fallback(error):
    rt = SparseVerificationRuntime(_config(ffn=True))  # fallback_to_dense is on by default
    with pytest.raises(type(error)):
        rt.run_sparse("ffn", _raise(error))
    assert rt.stats_summary() == {}


def test_strict_mode_raises_run_time_problems_with_their_cause():
    rt = SparseVerificationRuntime(_config(ffn=True, fallback_to_dense=False))
    with pytest.raises(RuntimeError, match="kernel_error.*fallback_to_dense is false") as info:
        rt.run_sparse("ffn", _raise(RuntimeError("kernel check failed")))
    assert isinstance(info.value.__cause__, RuntimeError)


def test_counters_that_cost_work_are_sampled():
    rt = SparseVerificationRuntime(_config(moe=False))
    assert [rt.should_sample(s) for s in range(1, 17)].count(True) == 16 // STATS_SAMPLE_EVERY
    rt.stats_sample_every = 1
    assert all(rt.should_sample(s) for s in range(5))


def test_weights_mode_is_fixed_at_start():
    rt = SparseVerificationRuntime(_config(ffn={"enabled": True, "weights": "shared"}))
    rt.set_sections({"ffn": {"enabled": False}})  # keeps "shared"
    assert rt.ffn.weights == "shared"
    with pytest.raises(SparseverConfigError, match="ffn.weights"):
        rt.set_sections({"ffn": {"enabled": True, "weights": "copy"}})
    rt = SparseVerificationRuntime(_config(ffn={"enabled": True, "gate": "stock"}))
    rt.set_sections({"ffn": {"enabled": True, "keep_ratio": 0.3}})  # keeps "stock"
    assert rt.ffn.gate == "stock"
    with pytest.raises(SparseverConfigError, match="ffn.gate"):
        rt.set_sections({"ffn": {"enabled": True, "gate": "kernel"}})


def test_dense_kernel_switches_off_and_back_but_not_on_from_vllm():
    rt = SparseVerificationRuntime(_config())
    assert rt.attention.dense_kernel == "auto"
    rt.set_sections({"attention": {"dense_kernel": "vllm"}})
    assert rt.attention.dense_kernel == "vllm"
    rt.set_sections({"attention": {"dense_kernel": "auto"}})
    assert rt.attention.dense_kernel == "auto"
    rt = SparseVerificationRuntime(_config(attention={"dense_kernel": "vllm"}))
    with pytest.raises(SparseverConfigError, match="attention.dense_kernel"):
        rt.set_sections({"attention": {"dense_kernel": "sparsever"}})
    # The same for decode steps.
    rt = SparseVerificationRuntime(_config())
    rt.set_sections({"attention": {"decode_kernel": "vllm"}})
    assert rt.attention.decode_kernel == "vllm"
    rt = SparseVerificationRuntime(_config(attention={"decode_kernel": "vllm"}))
    with pytest.raises(SparseverConfigError, match="attention.decode_kernel"):
        rt.set_sections({"attention": {"decode_kernel": "auto"}})


def test_start_refuses_a_target_without_sparsevers_attention_backend(monkeypatch):
    # A target whose attention layers got vLLM's stock CPU backend (another backend chosen for the
    # process first) would verify trees without their mask: start-up refuses it.
    from vllm_sparsever.compat import cpu_attention
    from vllm_sparsever.verification.sparse.attention import SparseverCPUAttentionImpl
    from vllm_sparsever.verification.sparse.setup import check_attention_backend

    rt = SparseVerificationRuntime(_config(tree=True))
    stock = object.__new__(cpu_attention.CPUAttentionBackendImpl)
    ours = object.__new__(SparseverCPUAttentionImpl)
    impls = [ours, stock]
    monkeypatch.setattr(cpu_attention, "attention_impls", lambda model: impls)
    check_attention_backend(None, rt)  # the backend was not registered: nothing to check
    rt.sparse_attention_backend = True
    with pytest.raises(RuntimeError, match="CPUAttentionBackendImpl, not sparsever's CPU attention backend"):
        check_attention_backend(None, rt)
    impls[1] = ours
    check_attention_backend(None, rt)
