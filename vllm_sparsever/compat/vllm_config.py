"""vLLM's `VllmConfig.num_lookahead_tokens`: KV slots the scheduler reserves past a step's tokens.

Private behaviour touched:
- `VllmConfig.num_lookahead_tokens` (a property; the scheduler reads it once at start, the KV cache
  manager allocates `num_computed + num_new + lookahead` slots, capped at max_model_len). vLLM
  reserves lookahead only for drafters it knows write KV past the target's query range (EAGLE,
  draft models). Self-drafting (drafting with the target's own first layers, which write those
  layers' KV for the next token and the drafts) needs the same reserve, while vLLM drives it as an
  n-gram-style CPU drafter. `reserve_extra_lookahead` wraps the property class-wide, once per
  process, and adds nothing for configurations its `extra` function does not claim.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_installed: Callable[[Any], int] | None = None


def vllm_config_cls() -> type:
    from vllm.config import VllmConfig

    return VllmConfig


def reserve_extra_lookahead(extra: Callable[[Any], int]) -> None:
    """`VllmConfig.num_lookahead_tokens` becomes max(vLLM's value, extra(vllm_config)). Idempotent
    for the same `extra`; a different one replaces it (tests)."""
    global _installed
    cls = vllm_config_cls()
    prop = cls.__dict__["num_lookahead_tokens"]
    original = getattr(prop.fget, "__sparsever_original__", prop.fget)
    if _installed is extra and prop.fget is not original:
        return

    def num_lookahead_tokens(self: Any) -> int:
        return max(original(self), extra(self))

    num_lookahead_tokens.__sparsever_original__ = original  # type: ignore[attr-defined]
    num_lookahead_tokens.__doc__ = original.__doc__
    setattr(cls, "num_lookahead_tokens", property(num_lookahead_tokens))
    _installed = extra


def restore_lookahead() -> None:
    """Undo `reserve_extra_lookahead` (tests)."""
    global _installed
    cls = vllm_config_cls()
    prop = cls.__dict__["num_lookahead_tokens"]
    original = getattr(prop.fget, "__sparsever_original__", None)
    if original is not None:
        setattr(cls, "num_lookahead_tokens", property(original))
    _installed = None
