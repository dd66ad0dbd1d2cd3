"""The registry through which the FFN/MoE custom ops reach their layers: weak, one key per instance."""

import gc

from vllm_sparsever.verification.sparse.op_modules import OpModuleRegistry


class _Layer:
    pass


def test_keys_are_per_instance_and_entries_leave_with_their_module():
    registry: OpModuleRegistry[_Layer] = OpModuleRegistry()
    a, b = _Layer(), _Layer()
    key_a, key_b = registry.add("model.layers.0.mlp", a), registry.add("model.layers.0.mlp", b)
    assert key_a != key_b  # two engines, same layer prefix
    assert registry[key_a] is a and registry[key_b] is b
    assert len(registry) == 2
    del a
    gc.collect()
    assert len(registry) == 1 and registry[key_b] is b
