"""Calibration options (no torch import: the CLI builds its parser from these defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_sparsever.config import AttentionSparsityConfig


class CalibrationError(RuntimeError):
    """Calibration cannot run as asked (text too short, unsupported model, ...)."""


_ATTN_DEFAULTS = AttentionSparsityConfig()
DEFAULT_DATA = ("wikipedia",)
DTYPE_NAMES = ("float32", "bfloat16", "float16")


@dataclass
class CalibrationOptions:
    max_tokens: int = 4096  # truncated to the model's max_position_embeddings
    num_draft_tokens: int = 3  # k; a verify window is k + 1 tokens (also the FFN token group)
    block_size: int = 128  # vLLM-CPU's default KV block size
    top_k_blocks: int = _ATTN_DEFAULTS.top_k_blocks
    num_sink_blocks: int = _ATTN_DEFAULTS.num_sink_blocks
    num_local_blocks: int = _ATTN_DEFAULTS.num_local_blocks
    min_context_len: int = _ATTN_DEFAULTS.min_context_len
    num_windows: int = 16
    # Above chance: two random top-16 choices of 17-30 blocks already agree at ~0.57.
    min_jaccard: float = 0.65
    ffn_mass: float = 0.9
    dtype: str = "float32"
    data: tuple[str, ...] = DEFAULT_DATA  # data-set categories (vllm_sparsever.data), in order
    text_file: str | None = None  # overrides `data`
    show_progress: bool = True
    keep_qk_layers: tuple[int, ...] = field(default_factory=tuple)  # tests: keep raw q/k of these

    def validate(self) -> None:
        positive = ("max_tokens", "num_draft_tokens", "block_size", "top_k_blocks", "num_windows",
                    "num_local_blocks")  # fmt: skip
        for name in positive:
            if int(getattr(self, name)) < 1:
                raise CalibrationError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_sink_blocks < 0 or self.min_context_len < 0:
            raise CalibrationError("num_sink_blocks and min_context_len must be >= 0")
        if not 0.0 < self.ffn_mass <= 1.0:
            raise CalibrationError(f"ffn_mass must be in (0, 1], got {self.ffn_mass}")
        if self.dtype not in DTYPE_NAMES:
            raise CalibrationError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}")
