"""Per-worker state of sparse verification: the knobs in force, per-layer values, step groups, stats.

One `SparseVerificationRuntime` per worker process, installed by the model runner at start
(`install_runtime`) and read by the sparse attention backend and the swapped FFN/MoE modules
(`get_runtime`). Layers ask it three things per verify step:
- `step_groups(plan)`: which tokens verify, grouped per request (computed once per step, FlashInfer's
  plan/run split; every layer reuses it);
- the per-layer value in force (`is_anchor`, `ffn_keep_ratio`, `moe_ratio_threshold`), resolved
  from the config, else the calibration profile, else built-in defaults;
- `record(...)`: how much was read versus dense (for metrics and the benchmark).

The attention/ffn/moe sections can be switched at run time (`set_sections`, an RPC used by the
benchmark to compare policies in one engine); what needs start-up work (the attention backend and
its key summaries, the FFN/MoE module swap) must have been enabled at start.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from vllm_sparsever.config import (
    DEFAULT_FFN_KEEP_RATIO,
    DEFAULT_MOE_RATIO_THRESHOLD,
    SparseverConfig,
    SparseverConfigError,
)
from vllm_sparsever.plan import VerificationPlan
from vllm_sparsever.verification.profile import CalibrationProfile

logger = logging.getLogger("vllm_sparsever")

_LAYER_RE = re.compile(r"\.layers\.(\d+)\.")


def layer_index_of(prefix: str) -> int | None:
    """Decoder layer index in a module name such as 'model.layers.7.mlp' (None if absent)."""
    m = _LAYER_RE.search(prefix + ".")
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class StepGroups:
    """The tokens a verify step sparsifies, one group per verifying request.

    `all_tokens_verify`: every token of the step belongs to a verify group, in order, so layers can
    run on the hidden states as they are (no gather). Otherwise `token_index` gathers the verify
    tokens and the rest (prefill chunks, plain decode rows) go through the dense path.
    `group_start_loc` [G+1] int32 indexes the gathered (or full) verify tokens.
    """

    num_tokens: int
    all_tokens_verify: bool
    token_index: torch.Tensor  # [Tv] long, positions of verify tokens in the step
    other_index: torch.Tensor  # [T - Tv] long, the remaining (dense) tokens
    group_start_loc: torch.Tensor  # [G+1] int32
    batch_rows: tuple[int, ...]  # the runner's batch row of each group (request)


# Knobs whose start-up work (KV layout, kept weights) fixes them for the engine's lifetime.
_START_UP_KNOBS = {"attention": ("kernel",), "ffn": ("weights",), "moe": ("weights",)}


class SparseVerificationRuntime:
    """Sparse verification knobs and state for one worker (see module docstring)."""

    def __init__(
        self,
        config: SparseverConfig,
        profile: CalibrationProfile | None = None,
        profile_source: str = "none",
        num_layers: int | None = None,
    ) -> None:
        self.config = copy.deepcopy(config)
        self.profile = profile
        self.profile_source = profile_source
        self.num_layers = num_layers
        # What was set up at start; run-time switches cannot go beyond it.
        self.started_with = {
            "attention": config.attention.enabled,
            "ffn": config.ffn.enabled,
            "moe": config.moe.enabled,
        }
        self.stats: Counter[str] = Counter()
        # Test hook: every sparse layer also runs the PyTorch reference on the same inputs and
        # records the largest difference (slow; for tests and debugging only).
        self.check_reference = os.environ.get("VLLM_SPARSEVER_CHECK_REFERENCE") == "1"
        self.reference_errors: dict[str, float] = {}
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    # ---- knobs --------------------------------------------------------------------------

    @property
    def attention(self):
        return self.config.attention

    @property
    def ffn(self):
        return self.config.ffn

    @property
    def moe(self):
        return self.config.moe

    def set_sections(self, sections: dict[str, Any]) -> dict[str, Any]:
        """Replace the attention/ffn/moe sections (validated like the start-up config)."""
        allowed = ("attention", "ffn", "moe")
        for name in sections:
            if name not in allowed:
                raise SparseverConfigError(
                    f"{name}: only {', '.join(allowed)} can be changed at run time"
                )
        raw = self.config.to_dict()
        passthrough = raw.pop("passthrough", {})
        for name, value in sections.items():
            value = {"enabled": value} if isinstance(value, bool) else dict(value)
            for knob in _START_UP_KNOBS[name]:  # unless given, keep what was chosen at start
                value.setdefault(knob, getattr(getattr(self.config, name), knob))
            raw[name] = value
        raw["profile"] = None  # already resolved; do not re-check the path
        new = SparseverConfig.from_dict({**raw, **passthrough})
        for name in allowed:
            if getattr(new, name).enabled and not self.started_with[name]:
                raise SparseverConfigError(
                    f"{name}.enabled: {name} sparsity was off at start, so its start-up work "
                    f"(backend, summaries, module swap) was not done; allowed at run time: false"
                )
        for name, knobs in _START_UP_KNOBS.items():
            for knob in knobs:
                chosen = getattr(getattr(self.config, name), knob)
                if getattr(getattr(new, name), knob) != chosen:
                    raise SparseverConfigError(
                        f"{name}.{knob}: chosen at start ({chosen!r}); it cannot change at run time"
                    )
        self.config.attention, self.config.ffn, self.config.moe = new.attention, new.ffn, new.moe
        return {name: getattr(self.config, name).__dict__ for name in allowed}

    def anchor_layers(self) -> list[int] | None:
        if self.attention.anchor_layers is not None:
            return self.attention.anchor_layers
        if self.profile is not None and self.profile.anchor_layers is not None:
            return self.profile.anchor_layers
        return None  # every layer selects

    def is_anchor(self, layer: int) -> bool:
        anchors = self.anchor_layers()
        return anchors is None or layer in anchors

    def ffn_keep_ratio(self, layer: int) -> float:
        profile = self.profile.ffn_keep_ratios if self.profile is not None else None
        return _per_layer(self.ffn.keep_ratio, profile, layer, DEFAULT_FFN_KEEP_RATIO)

    def moe_ratio_threshold(self, layer: int) -> float:
        profile = self.profile.moe_ratio_thresholds if self.profile is not None else None
        return _per_layer(self.moe.ratio_threshold, profile, layer, DEFAULT_MOE_RATIO_THRESHOLD)

    # ---- per step -----------------------------------------------------------------------

    def step_groups(self, plan: VerificationPlan) -> StepGroups | None:
        """Verify groups of the step (cached on the plan), None if nothing verifies."""
        if not plan.is_verify_step:
            return None
        cached = plan.extras.get("step_groups")
        if cached is not None:
            return cached
        device = plan.token_is_verify.device
        starts = [0]
        index: list[int] = []
        for req in plan.requests:  # requests are in batch (token) order
            index.extend(range(req.query_start, req.query_start + req.num_query_tokens))
            starts.append(len(index))
        all_verify = len(index) == plan.num_tokens
        token_index = torch.tensor(index, dtype=torch.long, device=device)
        mask = torch.ones(plan.num_tokens, dtype=torch.bool, device=device)
        mask[token_index] = False
        groups = StepGroups(
            num_tokens=plan.num_tokens,
            all_tokens_verify=all_verify,
            token_index=token_index,
            other_index=mask.nonzero().flatten(),
            group_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            batch_rows=tuple(r.batch_index for r in plan.requests),
        )
        plan.extras["step_groups"] = groups
        return groups

    # ---- bookkeeping --------------------------------------------------------------------

    def record(self, **counts: int | float) -> None:
        """Add to the read/dense counters, e.g. record(ffn_neurons_read=..., ffn_neurons_dense=...)."""
        with self._lock:
            self.stats.update({k: v for k, v in counts.items() if v})

    def record_reference_error(self, component: str, error: float) -> None:
        """Keep the largest |sparse - reference| seen per component (with `check_reference`)."""
        with self._lock:
            key = f"{component}_reference_max_abs_err"
            self.reference_errors[key] = max(self.reference_errors.get(key, 0.0), float(error))
            self.stats[f"{component}_reference_checks"] += 1

    def fallback(self, component: str, reason: str) -> None:
        """Note (and warn once per reason) that `component` verified densely this step; with
        `fallback_to_dense: false` the problem is raised instead."""
        if not self.config.fallback_to_dense:
            raise RuntimeError(f"sparsever: {component} sparse verification failed: {reason} "
                               f"(fallback_to_dense is false)")
        self.record(**{f"{component}_fallbacks": 1})
        key = f"{component}:{reason}"
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("sparsever: %s verifies densely: %s", component, reason)

    def stats_summary(self) -> dict[str, float]:
        with self._lock:
            return {**self.stats, **self.reference_errors}

    def reset_stats(self) -> None:
        with self._lock:
            self.stats.clear()
            self.reference_errors.clear()

    def describe(self) -> dict[str, Any]:
        return {
            "profile_source": self.profile_source,
            "anchor_layers": self.anchor_layers(),
            "sections": {n: getattr(self.config, n).__dict__ for n in ("attention", "ffn", "moe")},
            "started_with": dict(self.started_with),
        }


def _per_layer(configured: float | None, profile: list | None, layer: int, default: float) -> float:
    """The config's value for every layer, else the profile's for this layer, else the default."""
    if configured is not None:
        return configured
    if profile is not None and layer < len(profile) and profile[layer] is not None:
        return float(profile[layer])
    return default


_runtime: SparseVerificationRuntime | None = None


def install_runtime(runtime: SparseVerificationRuntime | None) -> None:
    global _runtime
    _runtime = runtime


def get_runtime() -> SparseVerificationRuntime | None:
    return _runtime
