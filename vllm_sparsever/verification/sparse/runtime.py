"""Per-worker state of sparse verification: the knobs in force, per-layer values, counters, fallbacks.

One `SparseVerificationRuntime` per worker process, installed by the model runner at start
(`install_runtime`) and read by the sparse attention backend and the wrapped FFN/MoE blocks
(`get_runtime`). Per-step data lives in the step's `VerificationPlan` (vllm_sparsever/plan.py),
not here. Layers ask the runtime:
- the per-layer value in force (`anchor_layers`, `ffn_keep_ratio`, `moe_ratio_threshold`), resolved
  from the config, else the calibration profile, else built-in defaults;
- `run_sparse(component, fn)`: run a sparse path under the one fallback policy (below);
- `record(...)`: how much was read versus dense (for metrics and the benchmark), from sizes the
  plan and the kernels already produce; what costs extra work to count is sampled
  (`should_sample(step)`).

Fallback policy (one place): a *run-time problem* in a sparse path (`SparsePathUnavailable`, raised
where the plugin detects a condition it cannot handle, or a RuntimeError raised by a kernel, e.g. an
input check or out-of-memory) makes that layer verify densely, counted per component and reason
and warned once per reason; with `fallback_to_dense: false` it is raised instead. A programming
error (TypeError, AttributeError, KeyError, IndexError, ValueError, NotImplementedError, ...,
e.g. after a vLLM change) is never turned into dense verification: it propagates.

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
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from vllm_sparsever.config import (
    DEFAULT_FFN_KEEP_RATIO,
    DEFAULT_MOE_RATIO_THRESHOLD,
    SparseverConfig,
    SparseverConfigError,
)
from vllm_sparsever.verification.sparse.profile import CalibrationProfile

logger = logging.getLogger("vllm_sparsever")

T = TypeVar("T")

# Counters that cost extra work (a second routing of the tokens) are taken on one verify step in
# this many (tests set VLLM_SPARSEVER_STATS_SAMPLE_EVERY=1); the rest come from sizes the plan and
# the kernels produce anyway.
STATS_SAMPLE_EVERY = 8
STATS_SAMPLE_ENV = "VLLM_SPARSEVER_STATS_SAMPLE_EVERY"


class SparsePathUnavailable(Exception):
    """A run-time condition under which a sparse path cannot run this step; it verifies densely.

    `reason` is a short fixed label (it becomes a counter name); `detail` is for the log only.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


_LAYER_RE = re.compile(r"\.layers\.(\d+)\.")


def layer_index_of(prefix: str) -> int | None:
    """Decoder layer index in a module name such as 'model.layers.7.mlp' (None if absent)."""
    m = _LAYER_RE.search(prefix + ".")
    return int(m.group(1)) if m else None


# Knobs whose start-up work (KV layout, kept weights) fixes them for the engine's lifetime.
_START_UP_KNOBS = {"attention": ("kernel",), "ffn": ("weights", "gate", "dense_kernel"), "moe": ("weights",)}


class SparseVerificationRuntime:
    """Sparse verification knobs and state for one worker (see module docstring)."""

    def __init__(
        self,
        config: SparseverConfig,
        profile: CalibrationProfile | None = None,
        profile_source: str = "none",
        num_layers: int | None = None,
        ffn_dense_kernel: str = "vllm",
        linear_kernel: str = "vllm",
        draft_int8_kernel: str = "vllm",
        draft_int4_kernel: str = "vllm",
    ) -> None:
        self.config = copy.deepcopy(config)
        self.profile = profile
        self.profile_source = profile_source
        self.num_layers = num_layers
        # What was set up at start; run-time switches cannot go beyond it.
        self.started_with = {
            "attention": config.attention.enabled,
            "ffn": config.ffn.enabled or ffn_dense_kernel == "sparsever",
            "moe": config.moe.enabled,
        }
        # Whether start-up registered sparsever's CPU attention backend (verification/sparse/setup.py).
        self.sparse_attention_backend = False
        # Dense verify and decode steps on sparsever's kernel may be switched off at run time and back on.
        self.dense_kernel_at_start = config.attention.dense_kernel
        self.decode_kernel_at_start = config.attention.decode_kernel
        self.stats: Counter[str] = Counter()
        # Counters the kernels write on the device (e.g. experts read): added there, read when the
        # stats are summarised, so the verify path never waits for the GPU.
        self.device_stats: dict[str, torch.Tensor] = {}
        self.stats_sample_every = max(1, int(os.environ.get(STATS_SAMPLE_ENV, STATS_SAMPLE_EVERY)))
        # Set by the sparse attention backend once it knows the KV layout and kernel (at KV cache
        # set-up): computes a verify step's AttentionStepPlan (see plan.build_verification_plan).
        self.attention_planner: Callable[..., Any] | None = None
        # The target's attention layers (set after it loads): only a builder serving them plans
        # steps, not the draft model's (another attention group when its head size differs).
        self.target_attention_layers: frozenset[str] = frozenset()
        # MoE targets (verification/lossless/expert_counter.py): (routed experts, top-k), and who wants each
        # verify request's (tokens, distinct experts) per layer (EVICT's expert-union model), if anyone.
        self.moe_routing: tuple[int, int] | None = None
        self.experts_observer: Callable[[int, int], None] | None = None
        self.ffn_gates: set[str] = set()  # where FFN layers run their dense gate (install_ffn)
        # ffn.dense_kernel resolved at start (verification/sparse/setup.py); with "sparsever", dense steps of up
        # to ffn_dense_op_max_tokens tokens run the FFN op at keep = I.
        self.ffn_dense_kernel = ffn_dense_kernel
        # linear_kernel resolved at start: "sparsever" = the target's dense linears on dense_linear,
        # "hybrid" = on it for steps of few tokens; how many layers of each model ("target", "draft
        # model") run it.
        self.linear_kernel = linear_kernel
        # draft_int8_kernel resolved at start ("auto" measured: verification/lossless/linear_kernel.py).
        self.draft_int8_kernel = draft_int8_kernel
        self.draft_int4_kernel = draft_int4_kernel  # (resolved at start, as draft_int8_kernel)
        self.linear_layers: dict[str, int] = {}
        self.ffn_dense_op_max_tokens = 0
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
        new = copy.copy(self.config)
        for name, value in sections.items():
            value = {"enabled": value} if isinstance(value, bool) else dict(value)
            for knob in _START_UP_KNOBS[name]:  # unless given, keep what was chosen at start
                value.setdefault(knob, getattr(getattr(self.config, name), knob))
            # Validated section by section: the rules across sections held at start and still do
            # (a hierarchy over the sparse target may run with every section off: it is then dense).
            setattr(new, name, SparseverConfig.section_from_dict(name, value))
        for name in allowed:
            if getattr(new, name).enabled and not self.started_with[name]:
                raise SparseverConfigError(
                    f"{name}.enabled: {name} sparsity was off at start, so its start-up work "
                    f"(backend, summaries, module swap) was not done; allowed at run time: false"
                )
        for knob in ("dense_kernel", "decode_kernel"):
            if getattr(new.attention, knob) != "vllm" and getattr(self, f"{knob}_at_start") == "vllm":
                raise SparseverConfigError(
                    f"attention.{knob}: 'vllm' at start, so sparsever's attention backend may not be "
                    "in place; allowed at run time: 'vllm'")
        for name, knobs in _START_UP_KNOBS.items():
            for knob in knobs:
                chosen = getattr(getattr(self.config, name), knob)
                if getattr(getattr(new, name), knob) != chosen:
                    raise SparseverConfigError(
                        f"{name}.{knob}: chosen at start ({chosen!r}); it cannot change at run time"
                    )
        self.config.attention, self.config.ffn, self.config.moe = new.attention, new.ffn, new.moe
        return {name: getattr(self.config, name).__dict__ for name in allowed}

    def step_planners(self) -> dict[str, Any]:
        """What `build_verification_plan` needs from the knobs in force this step."""
        if not self.attention.enabled or self.attention_planner is None:
            return {}
        return {"anchor_layers": self.anchor_layers(), "attention_planner": self.attention_planner}

    def anchor_layers(self) -> list[int] | None:
        if self.attention.anchor_layers is not None:
            return self.attention.anchor_layers
        if self.profile is not None and self.profile.anchor_layers is not None:
            return self.profile.anchor_layers
        return None  # every layer selects

    def ffn_keep_ratio(self, layer: int) -> float:
        profile = self.profile.ffn_keep_ratios if self.profile is not None else None
        return _per_layer(self.ffn.keep_ratio, profile, layer, DEFAULT_FFN_KEEP_RATIO)

    def moe_ratio_threshold(self, layer: int) -> float:
        profile = self.profile.moe_ratio_thresholds if self.profile is not None else None
        return _per_layer(self.moe.ratio_threshold, profile, layer, DEFAULT_MOE_RATIO_THRESHOLD)

    # ---- bookkeeping --------------------------------------------------------------------

    def record(self, **counts: int | float) -> None:
        """Add to the read/dense counters, e.g. record(ffn_neurons_read=..., ffn_neurons_dense=...).

        Called by every sparse layer of every verify step, so no lock: the forward runs in one
        thread, and readers copy the counters in one GIL-held operation (`stats_summary`)."""
        stats = self.stats
        for key, value in counts.items():
            if value:
                stats[key] += value

    def record_device(self, **counts: torch.Tensor) -> None:
        """Add device-side counts (one-element tensors the kernels wrote) without a device-to-host
        copy: they accumulate on their device and are read by `stats_summary`."""
        for key, value in counts.items():
            acc = self.device_stats.get(key)
            if acc is None:
                acc = self.device_stats[key] = torch.zeros((), dtype=torch.int64, device=value.device)
            acc.add_(value.reshape(()).to(acc.device, non_blocking=True))

    def record_reference_error(self, component: str, error: float) -> None:
        """Keep the largest |sparse - reference| seen per component (with `check_reference`)."""
        with self._lock:
            key = f"{component}_reference_max_abs_err"
            self.reference_errors[key] = max(self.reference_errors.get(key, 0.0), float(error))
            self.stats[f"{component}_reference_checks"] += 1

    def should_sample(self, step: int) -> bool:
        """Whether counters that cost extra work are taken on this step (see STATS_SAMPLE_EVERY)."""
        return step % self.stats_sample_every == 0

    def run_sparse(self, component: str, sparse: Callable[[], T]) -> T | None:
        """`sparse()`, or None when it hit a run-time problem and the layer must verify densely
        (see the module docstring for the policy). Programming errors propagate."""
        try:
            return sparse()
        except SparsePathUnavailable as exc:
            self.fallback(component, exc.reason, exc.detail, cause=exc)
        except NotImplementedError:
            raise  # a RuntimeError subclass, but a gap in the code, not a run-time condition
        except RuntimeError as exc:  # kernels (TORCH_CHECK), out of memory
            self.fallback(component, "kernel_error", f"{type(exc).__name__}: {exc}", cause=exc)
        return None

    def fallback(self, component: str, reason: str, detail: str = "", cause: BaseException | None = None) -> None:
        """Count (per component and reason) and warn once per reason that `component` verified
        densely this step; with `fallback_to_dense: false` raise instead."""
        if not self.config.fallback_to_dense:
            raise RuntimeError(
                f"sparsever: {component} sparse verification failed: {reason}"
                f"{f' ({detail})' if detail else ''} (fallback_to_dense is false)"
            ) from cause
        self.record(**{f"{component}_fallbacks": 1, f"{component}_fallback_{reason}": 1})
        key = f"{component}:{reason}"
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("sparsever: %s verifies densely: %s%s", component, reason,
                           f" ({detail})" if detail else "")

    def stats_summary(self) -> dict[str, float]:
        with self._lock:
            stats = Counter(self.stats)
            for key, acc in list(self.device_stats.items()):
                stats[key] += int(acc)  # the one device-to-host read, at scrape time
            return {**stats, **self.reference_errors}

    def reset_stats(self) -> None:
        with self._lock:
            self.stats.clear()
            self.device_stats.clear()
            self.reference_errors.clear()

    def describe(self) -> dict[str, Any]:
        return {
            "profile_source": self.profile_source,
            "anchor_layers": self.anchor_layers(),
            "sections": {n: getattr(self.config, n).__dict__ for n in ("attention", "ffn", "moe")},
            "started_with": dict(self.started_with),
            # where the wrapped FFN layers compute their dense gate ("stock"/"kernel"; ffn.gate resolved)
            "ffn_gate": sorted(self.ffn_gates),
            "ffn_dense_kernel": self.ffn_dense_kernel,
            "linear_kernel": self.linear_kernel,
            "draft_int8_kernel": self.draft_int8_kernel,
            "draft_int4_kernel": self.draft_int4_kernel,
            "linear_layers": dict(self.linear_layers),
            "ffn_dense_op_max_tokens": self.ffn_dense_op_max_tokens,
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
