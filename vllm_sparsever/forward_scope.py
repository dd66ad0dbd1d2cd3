"""What the forward now running verifies: its plan and its tree mask, visible to layers and ops.

A custom op cannot take the plan as an argument (ops take tensors and strings), so layers and ops
read it here, as vLLM's layers read its forward context. The runner makes a step's plan visible
for its target forward (`active_plan`); drafting's own passes that attend with a tree mask (tree
expansion, EAGLE heads) make only the mask visible (`tree_attention`), so they are never taken for
a target verification. Scopes nest and restore what was visible before. Held in a ContextVar, not
in module state: each scope is set and reset by the `with` block that owns it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from vllm_sparsever.plan import VerificationPlan


@dataclass(frozen=True)
class ForwardScope:
    plan: VerificationPlan | None = None  # the target verification now running, else None
    tree_mask: torch.Tensor | None = None  # [T, max_q_len] uint8 ancestor mask, else None (causal)


_scope: contextvars.ContextVar[ForwardScope] = contextvars.ContextVar("sparsever_forward_scope",
                                                                      default=ForwardScope())


def current_plan() -> VerificationPlan | None:
    """The plan of the target forward now running, or None outside one (draft model, warm-up)."""
    return _scope.get().plan


def current_tree_mask() -> torch.Tensor | None:
    """[T, max_q_len] uint8 ancestor mask of the forward now running, or None (causal)."""
    return _scope.get().tree_mask


@contextlib.contextmanager
def active_plan(plan: VerificationPlan | None) -> Iterator[None]:
    """Make `plan` visible to layers and ops for the duration of one target forward, and its tree
    mask (`TreeStep.mask`, None without trees) to attention."""
    mask = plan.tree.mask if plan is not None and plan.tree is not None else None
    token = _scope.set(ForwardScope(plan=plan, tree_mask=mask))
    try:
        yield
    finally:
        _scope.reset(token)


@contextlib.contextmanager
def tree_attention(mask: torch.Tensor | None) -> Iterator[None]:
    """Attention layers run inside attend with `mask` (see `TreeStep.mask`) instead of causally."""
    token = _scope.set(replace(_scope.get(), tree_mask=mask))
    try:
        yield
    finally:
        _scope.reset(token)
