"""Calibration profile: the per-model values sparse verification uses by default.

Written by `vllm-sparsever calibrate` (vllm_sparsever/offline/calibration), read by the worker at start.
One json file per target model; `default_profile_path(model)` is where the calibrate command writes
and where the worker looks when the config names no profile.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROFILE_VERSION = 1


@dataclass
class CalibrationProfile:
    """Per-layer values for one target model (layer indices are the model's decoder layers)."""

    model: str  # the target model path or name it was calibrated for
    num_layers: int
    # Attention: layers that select KV blocks; others reuse the previous anchor's selection.
    anchor_layers: list[int] | None = None
    # FFN: share of intermediate neurons kept per layer (None = layer has no dense SwiGLU MLP).
    ffn_keep_ratios: list[float | None] | None = None
    # MoE: routing-weight ratio threshold per layer (None = layer has no MoE block).
    moe_ratio_thresholds: list[float | None] | None = None
    # How it was measured (calibration text, block size, top-k, Jaccard per layer, ...).
    details: dict[str, Any] = field(default_factory=dict)
    version: int = PROFILE_VERSION

    def validate(self) -> None:
        def per_layer(name: str, values: list | None) -> None:
            if values is not None and len(values) != self.num_layers:
                raise ValueError(
                    f"calibration profile: {name} has {len(values)} entries, the model has "
                    f"{self.num_layers} layers"
                )

        if self.version != PROFILE_VERSION:
            raise ValueError(
                f"calibration profile: version {self.version} (allowed: {PROFILE_VERSION}); "
                f"re-run `vllm-sparsever calibrate`"
            )
        if self.anchor_layers is not None:
            a = self.anchor_layers
            if not a or a[0] != 0 or sorted(set(a)) != a or a[-1] >= self.num_layers:
                raise ValueError(
                    f"calibration profile: anchor_layers must be increasing layer indices starting "
                    f"at 0 and < {self.num_layers}, got {a}"
                )
        per_layer("ffn_keep_ratios", self.ffn_keep_ratios)
        per_layer("moe_ratio_thresholds", self.moe_ratio_thresholds)

    def save(self, path: str | os.PathLike) -> Path:
        self.validate()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True))
        os.replace(tmp, path)  # atomic: a reader never sees half a profile
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CalibrationProfile":
        data = json.loads(Path(path).read_text())
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"calibration profile {path}: unknown fields {unknown}")
        profile = cls(**data)
        profile.validate()
        return profile


def profiles_root() -> Path:
    root = os.environ.get("SPARSEVER_PROFILES_ROOT")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vllm-sparsever" / "profiles"


def default_profile_path(model: str) -> Path:
    """Where the profile of `model` (a path or name, as given to vLLM) lives by default."""
    resolved = os.path.realpath(model) if os.path.exists(model) else model
    digest = hashlib.sha256(resolved.encode()).hexdigest()[:12]
    name = Path(resolved.rstrip("/")).name or "model"
    return profiles_root() / f"{name}-{digest}.json"


def resolve_profile(profile_field: str | None, model: str) -> tuple[CalibrationProfile | None, str]:
    """The profile the worker uses and where it came from ('config', 'default', 'none')."""
    if profile_field == "none":
        return None, "none"
    if profile_field is not None:
        return CalibrationProfile.load(profile_field), f"config:{profile_field}"
    path = default_profile_path(model)
    if path.is_file():
        return CalibrationProfile.load(path), f"default:{path}"
    return None, "none"
