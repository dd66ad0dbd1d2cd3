"""`logit_bias` and `min_p` on the target's verification logits, so sparsever can honour them.

vLLM refuses both under speculative decoding: it then builds no min_p or logit-bias processor, and
its rejection sampler would not apply them to the draft positions' target logits anyway. sparsever
puts vLLM's processors back for the sampler's own rows (first and bonus tokens,
compat/sampling.py) and applies the two here to the draft rows, in the order vLLM's sampler
applies them to a non-speculative step, so every emitted token follows the same distribution as
without speculation (lossless):
- `logit_bias` is added to the raw logits before penalties (vLLM: non-argmax-invariant processors
  run before `apply_penalties`);
- `min_p` masks tokens whose probability after temperature is below `min_p` times the most likely
  one's, after penalties and before top-k/top-p (vLLM: argmax-invariant processors after
  temperature, before top-k/top-p). The rejection sampler divides by the temperature later; the
  mask (-inf) is unchanged by that division.

Rows: target logits hold each request's draft positions back to back, in batch order
(`num_draft_tokens[i]` rows for request i).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def needs_logits_params(params: Any) -> bool:
    """Whether a request's SamplingParams asks for anything this module applies."""
    return params is not None and (bool(getattr(params, "logit_bias", None)) or _min_p(params) > 0.0)


def _min_p(params: Any) -> float:
    # vLLM resets min_p to 0 for greedy requests; a temperature of 0 never reaches the mask.
    min_p = float(getattr(params, "min_p", 0.0) or 0.0)
    return min_p if float(getattr(params, "temperature", 1.0)) > 0.0 else 0.0


def _row_groups(num_draft_tokens: Sequence[int], params: Sequence[Any]):
    if len(num_draft_tokens) != len(params):
        raise ValueError(f"{len(num_draft_tokens)} requests' draft counts but {len(params)} sampling params")
    start = 0
    for n, p in zip(num_draft_tokens, params):
        if n and p is not None:
            yield start, start + int(n), p
        start += int(n)


def apply_logit_bias(logits: torch.Tensor, num_draft_tokens: Sequence[int], params: Sequence[Any]) -> torch.Tensor:
    """Add each request's `logit_bias` ({token id: bias}) to its draft rows, in place."""
    for start, end, p in _row_groups(num_draft_tokens, params):
        bias = getattr(p, "logit_bias", None)
        if bias:
            tokens = torch.tensor(list(bias.keys()), dtype=torch.long, device=logits.device)
            values = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
            logits[start:end, tokens] += values
    return logits


def apply_min_p(logits: torch.Tensor, num_draft_tokens: Sequence[int], params: Sequence[Any]) -> torch.Tensor:
    """Mask (-inf), in place, each sampled request's draft-row tokens whose probability at the
    request's temperature is below `min_p` x the row's highest (vLLM's `MinPLogitsProcessor`)."""
    for start, end, p in _row_groups(num_draft_tokens, params):
        min_p = _min_p(p)
        if min_p > 0.0:
            rows = logits[start:end]
            probs = torch.softmax(rows / float(p.temperature), dim=-1)
            threshold = probs.amax(dim=-1, keepdim=True) * min_p
            rows.masked_fill_(probs < threshold, float("-inf"))
    return logits


def honour_logits_params(runner: Any) -> None:
    """With speculative decoding vLLM applies min_p and logit_bias nowhere (no processors, and its
    rejection sampler skips them on draft rows); sparsever applies them everywhere: vLLM's own
    processors back for the sampler's rows, this module's functions on the draft rows."""
    from vllm_sparsever.compat.runner import batch_sampling_params
    from vllm_sparsever.compat.sampling import add_min_p_and_logit_bias_processors, wrap_draft_row_logits

    if wrap_draft_row_logits(runner, lambda: batch_sampling_params(runner), needs_logits_params, apply_logit_bias,
                             apply_min_p):
        add_min_p_and_logit_bias_processors(runner)
