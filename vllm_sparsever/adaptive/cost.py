"""Verification cost: measured offline per target model, predicted per step by EVICT.

`vllm-sparsever profile-verify MODEL` (offline/profile_verify_cli.py) starts the target in vLLM and times the
target's verify forward (every layer, the logits of every token) on the worker, over a grid of
rows x query tokens per row x context length, with the tree mask (sparsever's kernel) and
causally (chains). `VerifyCostProfile` fits, per mask, one linear model of the step time

    t = c0 + c1*T + c2*relu(T - 16) + c3*relu(T - 64) + c4*C + c5*sum_i(q_i*ctx_i) + c6*R [+ c7*X]

(T query tokens in the step, R rows, C context tokens read, q_i*ctx_i the attention work): the
weights are read once per step (c0), token work grows linearly and faster past the point where a
step stops being memory-bound (the relu knees), KV reads with the context, attention compute with
both. Fitted by non-negative least squares (every term costs time), it extrapolates sanely.

MoE targets add one term, c7*X, X the share of a layer's routed expert weights the step reads
(distinct routed experts / experts, averaged over the MoE layers): every routed expert a step's
tokens pick is read once. The profile measures each point twice, with random tokens (routing about
as spread as independent routing) and with one token repeated (every token picks the same experts),
and records X as the target's routers chose it, so the fit tells the experts' bytes from the
tokens' work. At run time EVICT predicts X from the step's token count with the expert-union model
measured online (adaptive/experts.py); a step whose tokens share experts costs less.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

PROFILE_FILE = "sparsever_verify_cost.json"
KNEES = (16, 64)
MASKS = ("tree", "chain")


def default_cost_profile_path(model: str | Path) -> Path:
    return Path(model) / PROFILE_FILE


@dataclass(frozen=True)
class Measurement:
    mask: str  # "tree" or "chain"
    rows: int
    query_tokens: int  # per row
    context: int  # per row, tokens already in the KV cache
    seconds: float  # median step time
    experts: float = 0.0  # MoE targets: share of routed expert weights read (see the module docstring)
    tokens: str = "random"  # "random", or "repeated" (one token: every token picks the same experts)


def features(query_tokens: list[int], contexts: list[int], experts: float = 0.0) -> np.ndarray:
    """The cost model's features of one step (see the module docstring); `experts`: X, 0 on dense targets."""
    t = float(sum(query_tokens))
    return np.array([1.0, t, max(t - KNEES[0], 0.0), max(t - KNEES[1], 0.0), float(sum(contexts)),
                     float(sum(q * c for q, c in zip(query_tokens, contexts, strict=True))), float(len(query_tokens)),
                     experts])


NUM_FEATURES = len(features([1], [0]))


def _nnls(a: np.ndarray, b: np.ndarray, iters: int = 2000) -> np.ndarray:
    """Non-negative least squares (projected gradient on the normal equations; small problems)."""
    scale = np.maximum(np.abs(a).max(axis=0), 1e-12)
    x_s = np.zeros(a.shape[1])
    an = a / scale
    gram, rhs = an.T @ an, an.T @ b
    step = 1.0 / max(np.linalg.eigvalsh(gram).max(), 1e-12)
    for _ in range(iters):
        x_s = np.maximum(x_s - step * (gram @ x_s - rhs), 0.0)
    return x_s / scale


@dataclass
class VerifyCostProfile:
    model: str
    hardware: str
    dtype: str
    measurements: list[Measurement] = field(default_factory=list)
    coef: dict[str, list[float]] = field(default_factory=dict)  # mask -> coefficients
    fit_error: dict[str, float] = field(default_factory=dict)  # mask -> mean relative error
    moe: list[int] | None = None  # MoE targets: [routed experts per layer, top-k]
    warnings: list[str] = field(default_factory=list)  # fit-time flags (non-monotone points)

    def fit(self) -> "VerifyCostProfile":
        self.warnings = non_monotone_points(self.measurements)
        for mask in MASKS:
            rows = [m for m in self.measurements if m.mask == mask]
            if not rows:
                continue
            a = np.stack([features([m.query_tokens] * m.rows, [m.context] * m.rows, m.experts) for m in rows])
            b = np.array([m.seconds for m in rows])
            # Relative error matters (a 5 ms step and a 500 ms step alike): weight rows by 1/t.
            w = 1.0 / b
            coef = _nnls(a * w[:, None], b * w)
            self.coef[mask] = coef.tolist()
            self.fit_error[mask] = float(np.mean(np.abs(a @ coef - b) / b))
        return self

    def predict(self, query_tokens: list[int], contexts: list[int], mask: str = "tree",
                experts: float | None = None) -> float:
        """Seconds of a verify step with these rows (query tokens incl. the root, contexts). MoE
        targets: `experts` is X (module docstring); None: as spread as independent routing."""
        coef = self.coef.get(mask) or self.coef.get("tree") or self.coef.get("chain")
        if coef is None:
            raise ValueError("verify cost profile has no fitted model")
        if experts is None:
            experts = self.independent_experts(sum(query_tokens))
        return float(features(query_tokens, contexts, experts) @ np.asarray(coef))

    def independent_experts(self, tokens: int) -> float:
        """X of `tokens` independently routed tokens (0 on a dense target)."""
        if not self.moe or tokens <= 0:
            return 0.0
        e, k = self.moe
        return 1.0 - (1.0 - k / e) ** tokens

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        data = asdict(self)
        path.write_text(json.dumps(data, indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "VerifyCostProfile":
        data = json.loads(Path(path).read_text())
        data["measurements"] = [Measurement(**m) for m in data.get("measurements", [])]
        profile = cls(**data)
        if not profile.coef or any(len(c) != NUM_FEATURES for c in profile.coef.values()):
            profile.fit()  # none saved, or saved by a version with other features
        return profile


MONOTONE_TOLERANCE = 0.05  # timing noise allowed before more tokens counts as faster


def non_monotone_points(measurements: list[Measurement]) -> list[str]:
    """Points measured faster than a point with fewer query tokens at the same mask, rows, context
    and tokens kind, by more than MONOTONE_TOLERANCE: a noisy measurement (the machine was busy),
    which the fit then averages over. One line per point."""
    out = []
    series: dict[tuple, list[Measurement]] = {}
    for m in measurements:
        series.setdefault((m.mask, m.rows, m.context, m.tokens), []).append(m)
    for points in series.values():
        points.sort(key=lambda m: m.query_tokens)
        slowest = None
        for m in points:
            if slowest is not None and m.seconds < slowest.seconds * (1 - MONOTONE_TOLERANCE):
                out.append(f"{m.mask} rows={m.rows} context={m.context}: {m.query_tokens} tokens took "
                           f"{1e3 * m.seconds:.1f} ms, {slowest.query_tokens} tokens {1e3 * slowest.seconds:.1f} ms "
                           f"(non-monotone: a noisy point; measure again on a quiet machine)")
            if slowest is None or m.seconds > slowest.seconds:
                slowest = m
    return out


def resolve_cost_profile(field_value: str | None, model: str) -> VerifyCostProfile:
    """The profile EVICT uses: the config's path, else the one profile-verify wrote in the model
    folder; a clear error when there is none."""
    path = Path(field_value) if field_value else default_cost_profile_path(model)
    if not path.is_file():
        raise RuntimeError(
            f"adaptive.cost_profile: no verify-cost profile at {str(path)!r}; measure one with "
            f"`vllm-sparsever profile-verify {model}` (or point adaptive.cost_profile at one)")
    return VerifyCostProfile.load(path)


def measurement_grid(max_model_len: int, rows: tuple[int, ...] = (1, 4, 8),
                     tokens: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
                     contexts: tuple[int, ...] = (256, 1024, 4096, 16384)) -> list[tuple[int, int, int]]:
    """(rows, query tokens per row, context) points: every token count at one row, fewer at more rows
    (a step holds at most 256 tokens), contexts up to max_model_len."""
    out = []
    for r in rows:
        for q in tokens:
            if r * q > 256 or (r > 1 and q > 16):
                continue
            for c in contexts:
                if c + q <= max_model_len:
                    out.append((r, q, c))
    return out


def summarize(profile: VerifyCostProfile) -> dict[str, Any]:
    def at(mask, r, q, c):
        return profile.predict([q] * r, [c] * r, mask)

    return {
        "fit_mean_relative_error": profile.fit_error,
        "tree_1x1_ctx1k_ms": 1e3 * at("tree", 1, 1, 1024),
        "tree_1x16_ctx1k_ms": 1e3 * at("tree", 1, 16, 1024),
        "tree_8x8_ctx1k_ms": 1e3 * at("tree", 8, 8, 1024),
        "marginal_token_ms_batch1": 1e3 * (at("tree", 1, 16, 1024) - at("tree", 1, 1, 1024)) / 15,
        "ok": all(math.isfinite(v) for v in profile.fit_error.values()),
    }
