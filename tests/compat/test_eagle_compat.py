"""vLLM internals sparsever's EAGLE support relies on: which targets vLLM's EAGLE-3 drafter can read
(compat.model.eagle3_target_supported), the aux-layer config key the trained heads carry, and what
sparsever uses to run a head itself in the hierarchy (compat.drafter.EagleHead, pass_states)."""

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


def test_drafter_samples_greedy_drafts_through_greedy_sample():
    """compat.drafter replaces `_greedy_sample` and `propose` on the drafter instance and reads the
    attributes that change how it samples."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    assert list(inspect.signature(SpecDecodeBaseProposer._greedy_sample).parameters) == ["self", "hidden_states"]
    sample = inspect.getsource(SpecDecodeBaseProposer._sample_draft_tokens)
    assert "return self._greedy_sample(hidden_states), None" in sample
    assert "self._sample_draft_tokens(" in inspect.getsource(SpecDecodeBaseProposer.propose)
    init = inspect.getsource(SpecDecodeBaseProposer.__init__)
    for attribute in ("self.use_local_argmax_reduction", "self.use_heterogeneous_vocab", "self.vocab_mapping"):
        assert attribute in init, attribute
    greedy = inspect.getsource(SpecDecodeBaseProposer._greedy_sample)
    assert "constrain_draft_logits" in greedy and "map_draft_to_target_ids" in greedy


def test_recorder_keeps_each_drafts_probability_and_returns_the_same_tokens():
    from types import SimpleNamespace

    import torch

    from vllm_sparsever.compat.drafter import proposed_drafts, record_drafter

    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0]])

    class Drafter:
        use_local_argmax_reduction = False
        use_heterogeneous_vocab = False
        model = SimpleNamespace(compute_logits=lambda hidden: logits)

        def _greedy_sample(self, hidden_states):
            return self.model.compute_logits(hidden_states).argmax(dim=-1)

        def propose(self):
            return torch.stack([self._greedy_sample(None), self._greedy_sample(None)], dim=1)

    runner = SimpleNamespace(drafter=Drafter())
    recorder, undo = record_drafter(runner)
    runner._draft_token_ids = runner.drafter.propose()
    assert proposed_drafts(runner) == [[1, 1], [0, 0]]
    assert len(recorder.probabilities) == 2 and recorder.seconds > 0
    assert torch.allclose(recorder.probabilities[0], torch.softmax(logits, -1).max(-1).values)
    undo()
    assert "_greedy_sample" not in vars(runner.drafter) and "propose" not in vars(runner.drafter)


def test_the_drafters_depth_per_step_is_the_scheduler_outputs_num_spec_tokens_to_schedule():
    import dataclasses

    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_sparsever.compat.drafter import with_draft_depth

    assert "num_spec_tokens_to_schedule" in {f.name for f in dataclasses.fields(SchedulerOutput)}
    propose = inspect.getsource(GPUModelRunner.propose_draft_token_ids)
    assert "num_spec_tokens_to_schedule = scheduler_output.num_spec_tokens_to_schedule" in propose
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    assert "self.num_speculative_tokens = num_speculative_tokens" in inspect.getsource(SpecDecodeBaseProposer.propose)
    out = SchedulerOutput.make_empty()
    copy = with_draft_depth(out, 2, 5)
    assert copy.num_spec_tokens_to_schedule == 2 and copy is not out and out.num_spec_tokens_to_schedule == 0
    with pytest.raises(ValueError):
        with_draft_depth(object(), 6, 5)


def test_the_runner_hands_its_drafter_the_steps_hidden_states_and_aux_streams():
    import torch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_sparsever.compat.drafter import pass_states

    params = list(inspect.signature(GPUModelRunner.propose_draft_token_ids).parameters)
    assert params[:7] == ["self", "scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states",
                          "sample_hidden_states", "aux_hidden_states"]
    hidden, aux = torch.zeros(3, 2), [torch.ones(3, 2), 2 * torch.ones(3, 2)]
    assert pass_states((None, hidden, None, aux), {}, aux=False) is hidden
    assert pass_states((None, hidden, None, aux), {}, aux=True)[0].tolist() == [1, 1, 2, 2]
    assert pass_states((), {"aux_hidden_states": aux}, aux=True).shape == (3, 4)
    assert pass_states((None, hidden, None, None), {}, aux=True) is None


@pytest.mark.parametrize("module, cls", [("vllm.model_executor.models.llama_eagle3", "Eagle3LlamaForCausalLM"),
                                         ("vllm.model_executor.models.llama_eagle", "EagleLlamaForCausalLM")])
def test_eagle_heads_take_tokens_positions_and_target_states(module, cls):
    import importlib

    head = getattr(importlib.import_module(module), cls)
    assert list(inspect.signature(head.forward).parameters)[1:4] == ["input_ids", "positions", "hidden_states"]
    assert callable(head.compute_logits)
    if cls.startswith("Eagle3"):
        assert callable(head.combine_hidden_states)
        # A trimmed draft vocabulary is mapped back to the target's inside compute_logits.
        assert "logits_new[:, targets] = logits" in inspect.getsource(head.compute_logits)
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    init = inspect.getsource(SpecDecodeBaseProposer.__init__)
    assert "self.method = self.speculative_config.method" in init
    assert "self.use_heterogeneous_vocab: bool = (" in init


def test_eagle_head_wraps_the_runners_drafter():
    from types import SimpleNamespace

    import torch

    from vllm_sparsever.compat.drafter import EagleHead

    attn = SimpleNamespace(attn=SimpleNamespace(layer_name="model.layers.2.self_attn.attn"))

    class _Model:
        model = SimpleNamespace(layers=[SimpleNamespace(self_attn=attn)])

        def __call__(self, input_ids, positions, hidden_states):
            return hidden_states + 1

        def combine_hidden_states(self, h):
            return h[:, :2]

    for method, combined in (("eagle3", [[1.0, 2.0]]), ("eagle", [[1.0, 2.0, 3.0, 4.0]])):
        drafter = SimpleNamespace(method=method, model=_Model(), use_heterogeneous_vocab=False)
        head = EagleHead(SimpleNamespace(drafter=drafter))
        assert head.layer_names == ["model.layers.2.self_attn.attn"] and head.reads_aux_streams == (method == "eagle3")
        assert head.combine(torch.tensor([[1.0, 2.0, 3.0, 4.0]])).tolist() == combined
        for_logits, for_next = head.forward(torch.tensor([1]), torch.tensor([0]), torch.zeros(1, 2))
        assert for_logits is for_next  # a head returning one tensor feeds it to both
    with pytest.raises(ValueError, match="allowed: eagle, eagle3"):
        EagleHead(SimpleNamespace(drafter=SimpleNamespace(method="mtp")))
    with pytest.raises(ValueError, match="heterogeneous vocabulary"):
        EagleHead(SimpleNamespace(drafter=SimpleNamespace(method="eagle3", model=_Model(),
                                                          use_heterogeneous_vocab=True)))
