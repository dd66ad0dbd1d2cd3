"""vLLM internals sparsever's EAGLE support relies on: which targets vLLM's EAGLE-3 drafter can read
(compat.model.eagle3_target_supported), and the aux-layer config key the trained heads carry."""

import inspect

import pytest

from vllm_sparsever.compat.model import eagle3_target_supported


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_models import make_tiny_llama, make_tiny_qwen2
    from tiny_moe import make_tiny_mixtral

    root = tmp_path_factory.mktemp("eagle_compat")
    return {"llama": make_tiny_llama(root / "llama"), "qwen2": make_tiny_qwen2(root / "qwen2"),
            "mixtral": make_tiny_mixtral(root / "mixtral")}


@pytest.mark.parametrize("kind, supported", [("llama", True), ("qwen2", True), ("mixtral", False)])
def test_eagle3_targets_are_the_model_classes_vllm_collects_layer_outputs_from(tiny, kind, supported):
    from vllm.config import ModelConfig

    assert eagle3_target_supported(ModelConfig(model=str(tiny[kind]), dtype="float32")) is supported


def test_heads_name_their_aux_layers_as_vllm_reads_them():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    # train-eagle writes `eagle_aux_hidden_state_layer_ids` at the top of the head's config.json.
    source = inspect.getsource(GPUModelRunner._get_eagle3_aux_layers_from_config)
    assert 'getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None)' in source
