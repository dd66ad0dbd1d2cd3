"""The runtime's knob resolution, run-time switch and fallback policy (no engine)."""

import pytest

from vllm_sparsever.config import SparseverConfig, SparseverConfigError
from vllm_sparsever.verification.profile import CalibrationProfile
from vllm_sparsever.verification.runtime import SparseVerificationRuntime


def _config(**raw):
    return SparseverConfig.from_dict({"method": "sparsever", "model": "d", "num_speculative_tokens": 3, **raw})


def test_values_come_from_config_then_profile_then_defaults():
    profile = CalibrationProfile(model="m", num_layers=3, anchor_layers=[0, 2],
                                 ffn_keep_ratios=[0.3, None, 0.7])
    rt = SparseVerificationRuntime(_config(ffn=True, attention=True), profile, "test", 3)
    assert [rt.is_anchor(i) for i in range(3)] == [True, False, True]
    assert rt.ffn_keep_ratio(0) == 0.3 and rt.ffn_keep_ratio(1) == 0.5  # None -> default
    rt.set_sections({"ffn": {"enabled": True, "keep_ratio": 0.9}, "attention": {"enabled": True, "anchor_layers": [0]}})
    assert rt.ffn_keep_ratio(0) == 0.9 and rt.anchor_layers() == [0]


def test_fallback_warns_and_counts_or_raises():
    rt = SparseVerificationRuntime(_config(ffn=True))
    rt.fallback("ffn", "boom")
    assert rt.stats_summary()["ffn_fallbacks"] == 1
    strict = SparseVerificationRuntime(_config(ffn=True, fallback_to_dense=False))
    with pytest.raises(RuntimeError, match="fallback_to_dense is false"):
        strict.fallback("ffn", "boom")


def test_weights_mode_is_fixed_at_start():
    rt = SparseVerificationRuntime(_config(ffn={"enabled": True, "weights": "shared"}))
    rt.set_sections({"ffn": {"enabled": False}})  # keeps "shared"
    assert rt.ffn.weights == "shared"
    with pytest.raises(SparseverConfigError, match="ffn.weights"):
        rt.set_sections({"ffn": {"enabled": True, "weights": "copy"}})
