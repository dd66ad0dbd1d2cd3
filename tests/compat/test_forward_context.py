"""vLLM's forward-context MoE layer counter (compat.forward_context)."""

import dataclasses

from vllm_sparsever.compat import forward_context as compat_fc


def test_forward_context_has_the_moe_counter():
    from vllm.forward_context import ForwardContext

    fields = {f.name: f for f in dataclasses.fields(ForwardContext)}
    assert "all_moe_layers" in fields and "moe_layer_index" in fields
    assert fields["moe_layer_index"].default == 0


def test_use_layername_flag_exists():
    import vllm.utils.torch_utils as torch_utils

    assert isinstance(torch_utils._USE_LAYERNAME, bool)
    assert compat_fc.moe_layers_found_by_counting() == (not torch_utils._USE_LAYERNAME)


def test_skip_moe_layer_slot_advances_the_counter_only_when_counting(monkeypatch):
    import vllm.utils.torch_utils as torch_utils
    from vllm.config import VllmConfig
    from vllm.forward_context import get_forward_context, set_forward_context

    compat_fc.skip_moe_layer_slot()  # outside a forward: no-op, no error
    config = VllmConfig()
    with set_forward_context(None, config):
        ctx = get_forward_context()
        ctx.all_moe_layers = ["a", "b"]
        monkeypatch.setattr(torch_utils, "_USE_LAYERNAME", False)
        compat_fc.skip_moe_layer_slot()
        assert ctx.moe_layer_index == 1
        monkeypatch.setattr(torch_utils, "_USE_LAYERNAME", True)
        compat_fc.skip_moe_layer_slot()
        assert ctx.moe_layer_index == 1


def test_set_forward_context_takes_num_tokens_and_slot_mapping():
    import inspect

    from vllm.forward_context import set_forward_context

    params = inspect.signature(set_forward_context).parameters
    assert list(params)[:2] == ["attn_metadata", "vllm_config"]
    assert "num_tokens" in params and "slot_mapping" in params
