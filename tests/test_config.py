"""SparseverConfig validation and its mapping onto vLLM's SpeculativeConfig."""

import pytest

from vllm_sparsever.config import SparseverConfig, SparseverConfigError


def test_defaults_are_off_and_map_to_draft_model():
    cfg = SparseverConfig.from_dict({"method": "sparsever", "model": "/m/draft", "num_speculative_tokens": 3})
    assert cfg.draft_source == "draft_model"
    assert not cfg.any_sparsity
    assert not cfg.adaptive.enabled and not cfg.early_exit.enabled
    assert cfg.to_vllm_speculative_kwargs() == {
        "method": "draft_model",
        "model": "/m/draft",
        "num_speculative_tokens": 3,
    }


def test_ngram_source_is_inferred_without_model():
    cfg = SparseverConfig.from_dict(
        {"method": "sparsever", "num_speculative_tokens": 4, "prompt_lookup_max": 5, "prompt_lookup_min": 2}
    )
    assert cfg.draft_source == "ngram"
    assert cfg.to_vllm_speculative_kwargs() == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 5,
        "prompt_lookup_min": 2,
    }


@pytest.mark.parametrize("source", ["eagle", "eagle3"])
def test_eagle_heads_map_to_vllms_method_with_the_head_as_model(source):
    cfg = SparseverConfig.from_dict({"method": "sparsever", "draft_source": source, "model": "/m/head",
                                     "num_speculative_tokens": 3, "attention": {"enabled": True}})
    assert cfg.to_vllm_speculative_kwargs() == {"method": source, "model": "/m/head", "num_speculative_tokens": 3}


@pytest.mark.parametrize("source", ["eagle", "eagle3"])
def test_the_sparse_hierarchy_and_trees_run_over_eagle_heads(source):
    """The hierarchy over an EAGLE head: vLLM still loads the head (its method), sparsever drafts
    with it in rounds, and the scheduler reserves the hierarchy's lookahead slots."""
    from types import SimpleNamespace

    from vllm_sparsever.integration.speculative import self_draft_lookahead

    cfg = SparseverConfig.from_dict({"method": "sparsever", "draft_source": source, "model": "/m/head",
                                     "num_speculative_tokens": 4, "ffn": {"enabled": True},
                                     "early_exit": {"enabled": True, "intermediate": "sparse", "round_tokens": 2}})
    assert cfg.to_vllm_speculative_kwargs() == {"method": source, "model": "/m/head", "num_speculative_tokens": 4}
    assert self_draft_lookahead(SimpleNamespace(additional_config={"sparsever": cfg.to_dict()})) == 4 + 2
    chains = SparseverConfig.from_dict({"method": "sparsever", "draft_source": source, "model": "/m/head",
                                        "num_speculative_tokens": 4, "adaptive": {"enabled": True}})
    assert self_draft_lookahead(SimpleNamespace(additional_config={"sparsever": chains.to_dict()})) == 0
    # Trees from the head: sparsever grows them (up to num_speculative_tokens nodes after the root).
    trees = SparseverConfig.from_dict({"method": "sparsever", "draft_source": source, "model": "/m/head",
                                       "num_speculative_tokens": 6, "tree": {"enabled": True}})
    assert self_draft_lookahead(SimpleNamespace(additional_config={"sparsever": trees.to_dict()})) == 6


def test_mtp_maps_to_vllms_method_without_a_model():
    cfg = SparseverConfig.from_dict({"method": "sparsever", "draft_source": "mtp", "num_speculative_tokens": 1})
    assert cfg.to_vllm_speculative_kwargs() == {"method": "mtp", "num_speculative_tokens": 1}


def test_drafting_off_proposes_nothing_and_needs_no_token_count():
    from types import SimpleNamespace

    from vllm_sparsever.drafting.factory import make_proposer
    from vllm_sparsever.step import DraftPlan

    cfg = SparseverConfig.from_dict({"method": "sparsever", "draft_source": "none"})
    assert cfg.num_speculative_tokens == 1
    # vLLM drives it like its n-gram drafter; sparsever's runner asks the proposer instead, which drafts nothing.
    assert cfg.to_vllm_speculative_kwargs() == {"method": "ngram", "num_speculative_tokens": 1}
    proposer = make_proposer(cfg, max_model_len=512)
    step = SimpleNamespace(req_ids=["a", "b"], depth=1)
    assert proposer.lookahead == 0 and proposer.plan_depth(step) == 0
    assert proposer.propose(step) == [[], []]
    assert proposer.plan() == DraftPlan()  # inside the step, vLLM's drafter not run, no target states


def test_passthrough_fields_reach_vllm():
    cfg = SparseverConfig.from_dict(
        {"method": "sparsever", "model": "d", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}
    )
    assert cfg.to_vllm_speculative_kwargs()["draft_tensor_parallel_size"] == 1


def test_serialization_round_trip():
    raw = {"method": "sparsever", "model": "d", "num_speculative_tokens": 2, "ffn": {"keep_ratio": 0.3},
           "max_model_len": 512}
    cfg = SparseverConfig.from_dict(raw)
    again = SparseverConfig.from_serialized(cfg.to_dict())
    assert again == cfg


@pytest.mark.parametrize(
    "raw, words",
    [
        ({"num_speculative_tokens": 3, "model": "d", "bogus": 1}, ["bogus", "allowed fields", "num_speculative_tokens"]),
        ({"model": "d"}, ["num_speculative_tokens", "required"]),
        ({"num_speculative_tokens": 0, "model": "d"}, ["num_speculative_tokens", ">= 1"]),
        ({"num_speculative_tokens": "3", "model": "d"}, ["num_speculative_tokens", "integer"]),
        ({"num_speculative_tokens": True, "model": "d"}, ["num_speculative_tokens", "integer"]),
        ({"num_speculative_tokens": 3, "draft_source": "medusa"},
         ["draft_source", "'draft_model', 'ngram', 'early_exit', 'eagle', 'eagle3', 'mtp', 'none'"]),
        ({"draft_source": "none", "model": "d"}, ["model", "must be omitted", "'none'"]),
        ({"draft_source": "none", "early_exit": {"enabled": True}}, ["early_exit.enabled", "'none'", "allowed"]),
        ({"draft_source": "none", "adaptive": {"enabled": True}}, ["adaptive.enabled", "draft_source='none'"]),
        ({"num_speculative_tokens": 3, "draft_source": "eagle3"}, ["model", "required", "eagle3 head"]),
        ({"num_speculative_tokens": 3, "draft_source": "mtp", "model": "h"}, ["model", "must be omitted", "mtp"]),
        ({"num_speculative_tokens": 3, "draft_source": "eagle", "model": "h", "early_exit": {"enabled": True}},
         ["early_exit.intermediate", "eagle head", "'sparse'", "'early_exit'"]),
        ({"num_speculative_tokens": 3, "draft_source": "mtp", "early_exit": {"enabled": True}},
         ["early_exit.enabled", "mtp", "'draft_model', 'ngram', 'early_exit', 'eagle', 'eagle3'"]),
        ({"num_speculative_tokens": 3, "draft_source": "mtp", "tree": {"enabled": True}},
         ["tree.enabled", "draft_source='mtp'", "'eagle3'"]),
        ({"num_speculative_tokens": 3, "draft_source": "draft_model"}, ["model", "required"]),
        ({"num_speculative_tokens": 3, "prompt_lookup_min": 5, "prompt_lookup_max": 2}, ["prompt_lookup_min", "<="]),
        ({"num_speculative_tokens": 3, "model": "d", "prompt_lookup_max": 2}, ["prompt_lookup_max", "ngram"]),
        ({"num_speculative_tokens": 3, "model": "d", "ffn": {"keep_ratio": 0}}, ["ffn.keep_ratio", "(0.0, 1.0]"]),
        ({"num_speculative_tokens": 3, "model": "d", "ffn": {"keep_ratio": 1.5}}, ["ffn.keep_ratio"]),
        ({"num_speculative_tokens": 3, "model": "d", "ffn": {"kep_ratio": 0.5}}, ["ffn.'kep_ratio'", "keep_ratio"]),
        ({"num_speculative_tokens": 3, "model": "d", "ffn": 3}, ["ffn", "object"]),
        ({"num_speculative_tokens": 3, "model": "d", "ffn": {"gate": "onednn"}},
         ["ffn.gate", "'auto', 'stock', 'kernel', 'input_sparse'"]),
        ({"num_speculative_tokens": 3, "model": "d", "ffn": {"gate_input_keep_ratio": 0}},
         ["ffn.gate_input_keep_ratio", "(0.0, 1.0]"]),
        ({"num_speculative_tokens": 3, "model": "d", "ffn": {"dense_kernel": "onednn"}},
         ["ffn.dense_kernel", "'auto', 'sparsever', 'vllm'"]),
        ({"num_speculative_tokens": 3, "model": "d", "ffn": {"enabled": True, "dense_kernel": "sparsever"}},
         ["ffn.dense_kernel", "ffn.weights 'shared'", "'auto', 'vllm'"]),
        ({"num_speculative_tokens": 3, "model": "d", "moe": {"expert_budget": 0}}, ["moe.expert_budget", ">= 1"]),
        ({"num_speculative_tokens": 3, "model": "d", "attention": {"anchor_layers": [3, 1]}},
         ["attention.anchor_layers", "increasing"]),
        ({"num_speculative_tokens": 3, "model": "d", "attention": {"enabled": "yes"}}, ["attention.enabled", "true or false"]),
        ({"num_speculative_tokens": 3, "model": "d", "attention": {"dense_kernel": "amx"}},
         ["attention.dense_kernel", "'auto', 'sparsever', 'vllm'"]),
        ({"num_speculative_tokens": 3, "model": "d", "attention": {"decode_kernel": "vec"}},
         ["attention.decode_kernel", "'auto', 'sparsever', 'vllm'"]),
        ({"num_speculative_tokens": 3, "model": "d", "linear_kernel": "onednn"},
         ["linear_kernel", "'auto', 'sparsever', 'hybrid', 'vllm', 'vllm-padded'"]),
        ({"num_speculative_tokens": 3, "model": "d", "draft_int8_kernel": "onednn"},
         ["draft_int8_kernel", "'auto', 'sparsever', 'hybrid', 'vllm'"]),
        ({"num_speculative_tokens": 3, "model": "d", "draft_int4_kernel": "w4a16"},
         ["draft_int4_kernel", "'auto', 'sparsever', 'hybrid', 'vllm'"]),
        ({"num_speculative_tokens": 3, "model": "d", "fallback_to_dense": 1}, ["fallback_to_dense"]),
    ],
)
def test_invalid_values_name_the_field(raw, words):
    with pytest.raises(SparseverConfigError) as info:
        SparseverConfig.from_dict({"method": "sparsever", **raw})
    message = str(info.value)
    for word in words:
        assert word in message, message


def test_adaptive_config(tmp_path):
    base = {"method": "sparsever", "model": "d", "num_speculative_tokens": 6}
    cfg = SparseverConfig.from_dict({**base, "adaptive": True})
    assert cfg.adaptive.enabled and cfg.adaptive.min_draft_tokens == 0 and cfg.adaptive.guard
    assert cfg.adaptive.depth == "auto"
    assert SparseverConfig.from_dict({**base, "adaptive": {"enabled": True, "depth": "cap"}}).adaptive.depth == "cap"
    profile = tmp_path / "cost.json"
    profile.write_text("{}")
    assert SparseverConfig.from_dict({**base, "adaptive": {"enabled": True, "cost_profile": str(profile)},
                                      "tree": True}).adaptive.cost_profile == str(profile)
    bad = [
        ({**base, "adaptive": {"enabled": True, "cost_profile": "/nope.json"}},
         ["adaptive.cost_profile", "profile-verify"]),
        ({**base, "adaptive": {"enabled": True, "min_draft_tokens": -1}}, ["adaptive.min_draft_tokens", ">= 0"]),
        ({**base, "adaptive": {"enabled": True, "depth": "deep"}}, ["adaptive.depth", "'auto'", "'cap'"]),
        ({"method": "sparsever", "num_speculative_tokens": 6, "adaptive": True, "tree": True},
         ["tree.enabled", "'draft_model'", "draft_source='ngram'"]),
        ({**base, "adaptive": True, "early_exit": {"enabled": True}}, ["adaptive.enabled", "hierarchical"]),
    ]
    for raw, words in bad:
        with pytest.raises(SparseverConfigError) as info:
            SparseverConfig.from_dict(raw)
        for word in words:
            assert word in str(info.value), (raw, str(info.value))


@pytest.mark.parametrize("section", ["attention", "ffn", "moe"])
def test_sparsity_sections_can_be_enabled(section):
    config = SparseverConfig.from_dict(
        {"method": "sparsever", "model": "d", "num_speculative_tokens": 3, section: {"enabled": True}}
    )
    assert getattr(config, section).enabled and config.any_sparsity


@pytest.mark.parametrize(
    "raw, words",
    [
        ({"attention": {"anchor_layers": [1, 2]}}, ["attention.anchor_layers", "layer 0"]),
        ({"attention": {"num_local_blocks": 0}}, ["attention.num_local_blocks", ">= 1"]),
        ({"moe": {"ratio_threshold": 1.5}}, ["moe.ratio_threshold", "[0.0, 1.0]"]),
        ({"moe": {"expert_budget": 0}}, ["moe.expert_budget", ">= 1"]),
        ({"profile": "/nonexistent/profile.json"}, ["profile", "calibrate", "'none'"]),
    ],
)
def test_sparsity_values_name_the_field(raw, words):
    with pytest.raises(SparseverConfigError) as info:
        SparseverConfig.from_dict({"method": "sparsever", "model": "d", "num_speculative_tokens": 3, **raw})
    for word in words:
        assert word in str(info.value), str(info.value)


def test_sparsity_on_unsupported_architecture_fails_in_front_end():
    from types import SimpleNamespace

    from vllm_sparsever.verification.support import check_sparsity_supported

    config = SparseverConfig.from_dict(
        {"method": "sparsever", "model": "d", "num_speculative_tokens": 3, "ffn": True}
    )
    mixtral = SimpleNamespace(architectures=["MixtralForCausalLM"], quantization=None)
    with pytest.raises(SparseverConfigError, match=r"ffn\.enabled: MixtralForCausalLM.*Qwen2ForCausalLM"):
        check_sparsity_supported(config, mixtral)
    config = SparseverConfig.from_dict(
        {"method": "sparsever", "model": "d", "num_speculative_tokens": 3, "moe": True}
    )
    llama = SimpleNamespace(architectures=["LlamaForCausalLM"], quantization=None)
    with pytest.raises(SparseverConfigError, match=r"moe\.enabled: LlamaForCausalLM.*MixtralForCausalLM"):
        check_sparsity_supported(config, llama)


def test_trees_on_a_sliding_window_model_fail_in_front_end():
    from types import SimpleNamespace

    from vllm_sparsever.verification.support import check_sparsity_supported

    config = SparseverConfig.from_dict({"method": "sparsever", "model": "d", "num_speculative_tokens": 6, "tree": True})
    windowed = SimpleNamespace(architectures=["MistralForCausalLM"], quantization=None,
                               get_sliding_window=lambda: 4096)
    with pytest.raises(SparseverConfigError, match=r"tree\.enabled: MistralForCausalLM uses sliding-window"):
        check_sparsity_supported(config, windowed)
    check_sparsity_supported(config, SimpleNamespace(architectures=["LlamaForCausalLM"], quantization=None,
                                                     get_sliding_window=lambda: None))


def test_engine_args_reject_bad_config_before_engine_start(tiny_target):
    """The error comes from create_engine_config in the front end: no engine process starts."""
    import vllm_sparsever

    vllm_sparsever.register()
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(tiny_target),
        speculative_config={"method": "sparsever", "model": str(tiny_target), "num_speculative_tokens": 2,
                            "attention": {"top_k_blocks": -1}},
    )
    with pytest.raises(SparseverConfigError, match=r"attention\.top_k_blocks"):
        args.create_engine_config()


def test_engine_args_map_sparsever_onto_vllm(tiny_target):
    import vllm_sparsever

    vllm_sparsever.register()
    from vllm.engine.arg_utils import EngineArgs

    from vllm_sparsever.integration.speculative import WORKER_CLS, sparsever_config_from_vllm

    args = EngineArgs(
        model=str(tiny_target),
        max_model_len=512,
        speculative_config={"method": "sparsever", "model": str(tiny_target), "num_speculative_tokens": 2},
    )
    vllm_config = args.create_engine_config()
    assert vllm_config.speculative_config.method == "draft_model"
    assert vllm_config.speculative_config.num_speculative_tokens == 2
    assert vllm_config.parallel_config.worker_cls == WORKER_CLS
    cfg = sparsever_config_from_vllm(vllm_config)
    assert cfg is not None and cfg.model == str(tiny_target)


def test_other_methods_are_untouched(tiny_target):
    import vllm_sparsever

    vllm_sparsever.register()
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(tiny_target),
        max_model_len=512,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
    )
    vllm_config = args.create_engine_config()
    assert vllm_config.speculative_config.method == "ngram"
    assert "sparsever" not in (vllm_config.additional_config or {})
    assert vllm_config.parallel_config.worker_cls != "vllm_sparsever.integration.worker.SparseverWorker"


def test_early_exit_config():
    base = {"method": "sparsever", "num_speculative_tokens": 8}
    cfg = SparseverConfig.from_dict({**base, "draft_source": "early_exit",
                                     "early_exit": {"enabled": True, "round_tokens": 2, "draft_confidence": 0.4}})
    assert cfg.early_exit.enabled and cfg.early_exit.round_tokens == 2
    assert cfg.to_vllm_speculative_kwargs() == {"method": "ngram", "num_speculative_tokens": 8}
    assert SparseverConfig.from_serialized(cfg.to_dict()) == cfg
    bad = [
        ({**base, "model": "d", "early_exit": {"enabled": True, "intermediate": "sparse"}},
         ["early_exit.intermediate", "no sparse section is enabled"]),
        ({**base, "model": "d", "early_exit": {"draft_layer": 3}}, ["early_exit.draft_layer", "only valid"]),
        ({**base, "draft_source": "early_exit", "model": "d"}, ["model", "must be omitted"]),
        ({**base, "draft_source": "early_exit", "prompt_lookup_max": 2}, ["prompt_lookup_max"]),
        ({**base, "draft_source": "early_exit", "early_exit": {"draft_confidence": 1.5}}, ["draft_confidence"]),
        ({**base, "draft_source": "early_exit", "early_exit": {"round_tokens": 0}}, ["round_tokens", ">= 1"]),
        ({**base, "draft_source": "early_exit", "early_exit": {"exit_layer": 3}}, ["unknown field", "draft_layer"]),
    ]
    for raw, words in bad:
        with pytest.raises(SparseverConfigError) as info:
            SparseverConfig.from_dict(raw)
        for word in words:
            assert word in str(info.value), (raw, str(info.value))


def test_hierarchy_config():
    base = {"method": "sparsever", "num_speculative_tokens": 6, "draft_source": "ngram"}
    sparse = {"enabled": True, "intermediate": "sparse"}
    cfg = SparseverConfig.from_dict({**base, "attention": True, "early_exit": sparse})
    assert cfg.early_exit.intermediate == "sparse" and not cfg.early_exit.uses_heads
    assert cfg.to_vllm_speculative_kwargs() == {"method": "ngram", "num_speculative_tokens": 6}
    # An n-gram drafter under an early-exit intermediate verifier uses exit heads; so does a draft model.
    assert SparseverConfig.from_dict({**base, "early_exit": {"enabled": True}}).early_exit.uses_heads
    cfg = SparseverConfig.from_dict({**base, "draft_source": "draft_model", "model": "d",
                                     "early_exit": {"enabled": True, "reuse_hidden_states": True}})
    assert cfg.to_vllm_speculative_kwargs() == {"method": "draft_model", "model": "d", "num_speculative_tokens": 6}
    bad = [
        ({**base, "early_exit": sparse}, ["early_exit.intermediate", "no sparse section is enabled"]),
        ({**base, "attention": True, "early_exit": {**sparse, "verify_layer": 2}},
         ["early_exit.verify_layer", "intermediate='early_exit'"]),
        ({**base, "attention": True, "early_exit": {**sparse, "intermediate": "dense"}},
         ["early_exit.intermediate", "'early_exit', 'sparse'"]),
        ({**base, "attention": True, "early_exit": {"intermediate": "sparse"}}, ["early_exit.enabled"]),
        ({**base, "attention": True, "early_exit": {**sparse, "reuse_hidden_states": True}},
         ["early_exit.reuse_hidden_states", "intermediate: 'early_exit'"]),
        ({**base, "early_exit": {"draft_layer": 2}}, ["early_exit.draft_layer", "only valid"]),
        ({**base, "early_exit": {"heads": "/h"}}, ["early_exit.heads", "only valid"]),
    ]
    for raw, words in bad:
        with pytest.raises(SparseverConfigError) as info:
            SparseverConfig.from_dict(raw)
        for word in words:
            assert word in str(info.value), (raw, str(info.value))


def test_tree_config():
    base = {"method": "sparsever", "num_speculative_tokens": 8, "model": "d"}
    cfg = SparseverConfig.from_dict({**base, "tree": {"enabled": True, "branching": 2}})
    assert cfg.tree.enabled and cfg.tree.branching == 2 and cfg.tree.expand == 3
    assert cfg.to_vllm_speculative_kwargs() == {"method": "draft_model", "model": "d", "num_speculative_tokens": 8}
    assert SparseverConfig.from_dict({**base, "tree": True, "attention": {"enabled": True, "kernel": "sparsever"}})
    bad = [
        ({**base, "tree": {"enabled": True, "branching": 0}}, ["tree.branching", ">= 1"]),
        ({**base, "tree": {"enabled": True, "width": 2}}, ["tree.'width'", "branching, expand, depth"]),
        ({"method": "sparsever", "num_speculative_tokens": 8, "tree": True},
         ["tree.enabled", "'draft_model'", "draft_source='ngram'"]),
        ({**base, "tree": True, "attention": {"enabled": True, "kernel": "vllm"}}, ["attention.kernel", "tree mask"]),
        ({**base, "tree": True, "early_exit": {"enabled": True}}, ["tree.enabled", "early_exit.enabled=false"]),
    ]
    # EVICT chains take n-gram drafts too (no trees: an n-gram match has one continuation).
    ngram = SparseverConfig.from_dict({"method": "sparsever", "num_speculative_tokens": 5, "adaptive": True})
    assert ngram.draft_source == "ngram" and ngram.adaptive.enabled and not ngram.tree.enabled
    for raw, words in bad:
        with pytest.raises(SparseverConfigError) as info:
            SparseverConfig.from_dict(raw)
        for word in words:
            assert word in str(info.value), (raw, str(info.value))


def test_draft_model_vocab_and_window_config():
    base = {"method": "sparsever", "model": "d", "num_speculative_tokens": 4}
    for section in ({"adaptive": {"enabled": True}}, {"tree": {"enabled": True}}):
        cfg = SparseverConfig.from_dict({**base, **section, "draft_vocab": 32768, "draft_attention_window": 1024})
        assert cfg.draft_vocab == 32768 and cfg.draft_attention_window == 1024
        assert not {"draft_vocab", "draft_attention_window"} & set(cfg.to_vllm_speculative_kwargs())
    bad = [
        ({**base, "adaptive": True, "draft_vocab": 0}, ["draft_vocab", ">= 1"]),
        ({**base, "adaptive": True, "draft_vocab": "all"}, ["draft_vocab", "integer"]),
        ({**base, "draft_vocab": 1024}, ["draft_vocab", "adaptive.enabled, tree.enabled or early_exit.enabled"]),
        ({"method": "sparsever", "num_speculative_tokens": 4, "adaptive": True, "draft_vocab": 1024},
         ["draft_vocab", "draft_source='draft_model'", "early_exit.draft_vocab"]),
        ({**base, "adaptive": True, "draft_attention_window": 0}, ["draft_attention_window", ">= 1"]),
        ({**base, "draft_attention_window": 512}, ["draft_attention_window", "adaptive.enabled"]),
        ({"method": "sparsever", "num_speculative_tokens": 4, "adaptive": True, "draft_attention_window": 512},
         ["draft_attention_window", "draft_source='draft_model'"]),
    ]
    for raw, words in bad:
        with pytest.raises(SparseverConfigError) as info:
            SparseverConfig.from_dict(raw)
        for word in words:
            assert word in str(info.value), (raw, str(info.value))
