"""vLLM's forward context: per-step state that custom ops read by counting.

Private symbols touched:
- `vllm.utils.torch_utils._USE_LAYERNAME`: whether MoE custom ops receive their layer by name (an
  opaque object) or find it by counting calls;
- `ForwardContext.all_moe_layers` / `.moe_layer_index`: the counter `_moe_forward` advances per MoE
  layer when names are not passed;
- `set_forward_context(attn_metadata, vllm_config, num_tokens=, slot_mapping=)`: the per-layer
  slot-mapping keyword is recent and vLLM-internal in use (the runner's own call passes it);
- public: `vllm.forward_context.get_forward_context`, `is_forward_context_available`.
"""

from __future__ import annotations


def moe_layers_found_by_counting() -> bool:
    """True when vLLM's MoE op finds its layer by counting calls in the forward context."""
    from vllm.utils.torch_utils import _USE_LAYERNAME

    return not _USE_LAYERNAME


def skip_moe_layer_slot() -> None:
    """Advance vLLM's per-step MoE layer counter for a layer whose stock forward did not run, so the
    following layers still find theirs. No-op when layers are passed by name or outside a forward."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not moe_layers_found_by_counting() or not is_forward_context_available():
        return
    ctx = get_forward_context()
    if ctx.all_moe_layers is not None:
        ctx.moe_layer_index += 1


def query_forward_context(attn_metadata, vllm_config, num_tokens: int, slot_mapping):
    """The forward context sparsever's own passes (self-drafting, early exits, tree queries) run the
    target's layers under: per-layer attention metadata and per-layer slot mapping."""
    from vllm.forward_context import set_forward_context

    return set_forward_context(attn_metadata, vllm_config, num_tokens=num_tokens, slot_mapping=slot_mapping)
