"""`calibrate(model)`: measure a model's per-layer sparse-verification values and write its profile.

The target model runs once with Hugging Face transformers (CPU, not vLLM) over calibration text from
the project's data sets (or a text file); `capture.capture` reduces each layer's activations to
statistics as the forward pass goes, and this module turns them into a `CalibrationProfile`:

* anchor layers: on simulated verify steps (window = last accepted token + k draft tokens after a
  long context), every layer's KV block selection is made as the runtime makes it; layer 0 anchors,
  layer l reuses the current anchor a while the mean Jaccard similarity of their selections (the
  blocks picked by score, over windows and KV heads) is >= min_jaccard, else l is the new anchor;
* FFN keep ratio per layer: median over groups of k+1 consecutive tokens of the smallest share of
  neurons covering `ffn_mass` of the group's summed |silu(gate)|, rounded up to a 1/64 grid;
* MoE ratio threshold per layer: median over tokens and top-k slots j >= 1 of p_j / p_top1.
"""

from __future__ import annotations

import hashlib
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_sparsever.offline.calibration.capture import (
    ATTN_IMPLEMENTATION,
    CaptureResult,
    capture,
    chance_jaccard,
    greedy_anchors,
    jaccard,
    plan_windows,
    register_attention,
)
from vllm_sparsever.offline.calibration.options import CalibrationError, CalibrationOptions
from vllm_sparsever.verification.sparse.profile import CalibrationProfile, default_profile_path

KEEP_RATIO_GRID = 64
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class CalibrationResult:
    profile: CalibrationProfile
    path: Path | None
    seconds: float
    capture: CaptureResult


# ---- inputs ------------------------------------------------------------------------------------


def resolve_model_dir(name_or_path: str) -> str:
    """A local folder as it is; otherwise a model built by `vllm-sparsever models build NAME` (an unknown
    or unbuilt one: the CLI's one-line error naming MODEL)."""
    from vllm_sparsever.models import resolve_model_arg

    return resolve_model_arg(name_or_path, "MODEL")


def _row_text(row: dict[str, Any]) -> str:
    text = row.get("document") or row.get("prompt") or ""
    reference = row.get("reference")
    if isinstance(reference, str) and reference and not row.get("document"):
        text = f"{text}\n{reference}"  # wikipedia: prompt = article start, reference = the rest
    return text


def calibration_text(options: CalibrationOptions, min_chars: int) -> tuple[str, dict[str, Any]]:
    """Text from `options.text_file`, else rows of the built data sets, and where it came from."""
    if options.text_file:
        text = Path(options.text_file).read_text(encoding="utf-8")
        return text, {"text_file": str(Path(options.text_file).resolve())}
    from vllm_sparsever.data import load_prompts

    parts: list[str] = []
    used: list[str] = []
    total = 0
    for category in options.data:
        for row in load_prompts(category):
            text = _row_text(row).strip()
            if not text:
                continue
            parts.append(text)
            used.append(str(row.get("id", category)))
            total += len(text) + 2
            if total >= min_chars:
                break
        if total >= min_chars:
            break
    if not parts:
        raise CalibrationError(f"no calibration text in data categories {list(options.data)}")
    return "\n\n".join(parts), {"data": list(options.data), "rows": used}


def load_model(model_dir: str, dtype: str = "float32"):
    """The HF model (CPU, recording attention registered) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    register_attention()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=DTYPES[dtype], attn_implementation=ATTN_IMPLEMENTATION
    )
    model.eval()
    return model, tokenizer


# ---- reductions --------------------------------------------------------------------------------


def median(values: torch.Tensor) -> float:
    """The usual median (mean of the two middle values for an even count)."""
    return float(statistics.median(values.double().tolist()))


def round_keep_ratio(share: float) -> float:
    """Up to the 1/64 grid, within (0, 1] (the runtime keeps ceil(ratio * I) neurons)."""
    grid = math.ceil(share * KEEP_RATIO_GRID - 1e-9) / KEEP_RATIO_GRID
    return min(1.0, max(1.0 / KEEP_RATIO_GRID, grid))


def jaccard_matrix(result: CaptureResult) -> list[list[float]]:
    """J[a][l] for a <= l (upper triangle, 1 on the diagonal; the lower triangle mirrors it)."""
    n = len(result.layers)
    mat = [[1.0] * n for _ in range(n)]
    for a in range(n):
        for b in range(a + 1, n):
            mat[a][b] = mat[b][a] = jaccard(result.layers[a].chosen, result.layers[b].chosen)
    return mat


def build_profile(result: CaptureResult, options: CalibrationOptions, model: str,
                  source: dict[str, Any] | None = None) -> CalibrationProfile:
    """The profile from one capture (anchors depend on options.min_jaccard only: no re-run needed)."""
    num_layers = len(result.layers)
    mat = jaccard_matrix(result)
    anchors, decided = greedy_anchors(mat, options.min_jaccard)

    keep: list[float | None] = []
    keep_raw: list[float | None] = []
    for stats in result.layers:
        if stats.ffn_shares is None or stats.ffn_shares.numel() == 0:
            keep.append(None)
            keep_raw.append(None)
        else:
            m = median(stats.ffn_shares)
            keep_raw.append(round(m, 5))
            keep.append(round_keep_ratio(m))
    any_ffn = any(v is not None for v in keep)

    thresholds: list[float | None] = []
    for stats in result.layers:
        if stats.moe_ratios is None or stats.moe_ratios.numel() == 0:
            thresholds.append(None)
        else:
            thresholds.append(min(1.0, max(0.0, median(stats.moe_ratios))))
    any_moe = any(v is not None for v in thresholds)

    plan = result.plan
    details: dict[str, Any] = {
        "tool": "vllm-sparsever calibrate",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "text": {**(source or {}), "num_tokens": result.num_tokens},
        "dtype": options.dtype,
        "mlp_kinds": result.mlp_kinds,
        "attention": {
            "block_size": plan.block_size,
            "num_draft_tokens": plan.window - 1,
            "top_k_blocks_requested": plan.top_k_requested,
            "top_k_blocks": plan.top_k,
            "top_k_scaled_down": plan.top_k_scaled,
            "num_sink_blocks": plan.num_sink,
            "num_local_blocks": plan.num_local,
            "min_context_len": options.min_context_len,
            "min_context_len_applied": plan.min_context_len_applied,
            "window_context_lens": list(plan.ctx_lens),
            "min_jaccard": options.min_jaccard,
            "jaccard_over": "blocks chosen by score (sink and local blocks excluded), mean over "
                            "windows and KV heads",
            # per layer: J(current anchor, layer) that decided reuse (None for layer 0)
            "jaccard_chance": round(chance_jaccard(plan), 4),
            "jaccard_to_anchor": [None if v is None else round(v, 4) for v in decided],
            "jaccard_to_previous": [None] + [round(mat[i - 1][i], 4) for i in range(1, num_layers)],
            "jaccard_matrix": [[round(v, 3) for v in row] for row in mat],
        },
        "ffn": {
            "mass": options.ffn_mass,
            "group_tokens": plan.window,
            "grid": KEEP_RATIO_GRID,
            "median_share_unrounded": keep_raw,
        }
        if any_ffn
        else None,
        "moe": {"top_k": result.moe_top_k, "num_experts": result.num_experts,
                "statistic": "median over tokens and slots j>=1 of p_j / p_top1"}
        if any_moe
        else None,
    }
    profile = CalibrationProfile(
        model=model,
        num_layers=num_layers,
        anchor_layers=anchors,
        ffn_keep_ratios=keep if any_ffn else None,
        moe_ratio_thresholds=thresholds if any_moe else None,
        details=details,
    )
    profile.validate()
    return profile


# ---- the command -------------------------------------------------------------------------------


def calibrate(
    model: str,
    options: CalibrationOptions | None = None,
    output: str | os.PathLike | None = None,
    *,
    write: bool = True,
) -> CalibrationResult:
    """Calibrate `model` (a built model name or a folder) and write its profile (to
    `default_profile_path(model folder)` unless `output`)."""
    options = options or CalibrationOptions()
    options.validate()
    start = time.perf_counter()
    model_dir = resolve_model_dir(model)
    hf_model, tokenizer = load_model(model_dir, options.dtype)
    max_pos = getattr(hf_model.config, "max_position_embeddings", None) or options.max_tokens
    max_tokens = min(options.max_tokens, int(max_pos))
    text, source = calibration_text(options, min_chars=max_tokens * 8)
    source["sha256"] = hashlib.sha256(text.encode()).hexdigest()[:16]
    ids = tokenizer(text, return_tensors="pt")["input_ids"][:, :max_tokens]
    plan = plan_windows(
        int(ids.shape[1]),
        num_draft_tokens=options.num_draft_tokens,
        block_size=options.block_size,
        top_k=options.top_k_blocks,
        num_sink=options.num_sink_blocks,
        num_local=options.num_local_blocks,
        num_windows=options.num_windows,
        min_context_len=options.min_context_len,
    )
    result = capture(hf_model, ids, plan, ffn_mass=options.ffn_mass,
                     keep_qk_layers=options.keep_qk_layers, show_progress=options.show_progress)
    profile = build_profile(result, options, model_dir, source)
    seconds = time.perf_counter() - start
    profile.details["seconds"] = round(seconds, 1)
    profile.details["options"] = {k: v for k, v in asdict(options).items()
                                  if k not in ("show_progress", "keep_qk_layers")}
    path = None
    if write:
        path = profile.save(output if output is not None else default_profile_path(model_dir))
    return CalibrationResult(profile=profile, path=path, seconds=seconds, capture=result)


def summary(result: CalibrationResult) -> str:
    p = result.profile
    att = p.details["attention"]
    sims = [v for v in att["jaccard_to_anchor"] if v is not None]
    top_k = str(att["top_k_blocks"])
    if att["top_k_scaled_down"]:
        top_k += f" (scaled down from {att['top_k_blocks_requested']}: short text)"
    lines = [
        f"model: {p.model}",
        (
            f"layers: {p.num_layers}  tokens: {p.details['text']['num_tokens']}  "
            f"windows: {len(att['window_context_lens'])}  time: {result.seconds:.1f} s"
        ),
        (
            f"anchors ({len(p.anchor_layers)}/{p.num_layers}, min Jaccard {att['min_jaccard']}, "
            f"top-k {top_k} of {att['block_size']}-token blocks): {p.anchor_layers}"
        ),
        (
            f"jaccard to anchor: min {min(sims):.3f} mean {sum(sims) / len(sims):.3f} "
            f"(two random selections: {att['jaccard_chance']:.3f})"
            if sims
            else "jaccard: single layer"
        ),
    ]
    if sims and att["min_jaccard"] <= att["jaccard_chance"]:
        lines.append(
            f"note: --min-jaccard {att['min_jaccard']} is not above the chance level "
            f"{att['jaccard_chance']:.3f} of these windows, so even unrelated layers reuse their "
            f"anchor's blocks; raise --min-jaccard, or use more --max-tokens / a smaller --top-k-blocks"
        )
    if p.ffn_keep_ratios is not None:
        vals = [v for v in p.ffn_keep_ratios if v is not None]
        lines.append(
            f"ffn keep ratio (mass {p.details['ffn']['mass']}): mean {sum(vals) / len(vals):.3f} "
            f"min {min(vals):.3f} max {max(vals):.3f}"
        )
    if p.moe_ratio_thresholds is not None:
        vals = [v for v in p.moe_ratio_thresholds if v is not None]
        lines.append(
            f"moe ratio threshold (top-{p.details['moe']['top_k']}): mean {sum(vals) / len(vals):.3f} "
            f"min {min(vals):.3f} max {max(vals):.3f}"
        )
    if result.path is not None:
        lines.append(f"profile: {result.path}")
    return "\n".join(lines)

