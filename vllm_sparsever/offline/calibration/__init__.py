"""`vllm-sparsever calibrate`: per-model anchor layers, FFN keep ratios and MoE thresholds.

    from vllm_sparsever.offline.calibration import CalibrationOptions
    from vllm_sparsever.offline.calibration.calibrate import calibrate, summary
    result = calibrate("smollm2-135m", CalibrationOptions(max_tokens=4096))
    print(summary(result))           # anchors, keep ratios, thresholds; result.path = the profile

Runs the target with Hugging Face transformers on CPU (not vLLM); see docs/calibration.md.
Modules: `options` (knobs, no torch import), `capture` (the forward pass and per-layer
reductions), `calibrate` (text, model loading, the profile), `cli` (the sub-command).
"""

from vllm_sparsever.offline.calibration.options import CalibrationError, CalibrationOptions

__all__ = ["CalibrationError", "CalibrationOptions"]
