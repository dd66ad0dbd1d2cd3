"""EngineArgs.create_speculative_config and vLLM's `--spec-*` alias merge (compat.engine_args)."""

import inspect
from types import SimpleNamespace

import pytest

from vllm_sparsever.compat import check_signature
from vllm_sparsever.compat import engine_args as compat_args


def _vllm_create_speculative_config():
    """vLLM's own method (unwrapped if the plugin already wrapped it in this process)."""
    method = compat_args.engine_args_cls().create_speculative_config
    return inspect.unwrap(method)


def test_create_speculative_config_signature():
    cls = compat_args.engine_args_cls()
    assert check_signature(cls, "create_speculative_config",
                           compat_args.CREATE_SPECULATIVE_CONFIG_PARAMS) is None


def test_spec_alias_flags_exist_on_engine_args():
    fields = {f.name for f in __import__("dataclasses").fields(compat_args.engine_args_cls())}
    for _, _, attr in compat_args.SPEC_CLI_ALIASES:
        assert attr in fields


def _args(spec, method=None, model=None, tokens=None):
    return SimpleNamespace(speculative_config=spec, spec_method=method, spec_model=model, spec_tokens=tokens)


CASES = [
    (None, "ngram", None, 3),
    ({"model": "draft", "num-speculative-tokens": 2}, "draft_model", None, None),
    ({"method": "draft_model"}, None, "draft", 4),
    ({"method": "ngram", "prompt_lookup_max": 3}, None, None, None),
    (None, None, None, None),
]


@pytest.mark.parametrize("spec,method,model,tokens", CASES)
def test_merge_matches_vllm(spec, method, model, tokens, monkeypatch):
    """vLLM's merge and ours give the same speculative kwargs for the same flags and dict."""
    import vllm.engine.arg_utils as arg_utils

    monkeypatch.setattr(arg_utils, "SpeculativeConfig", lambda **kwargs: kwargs)  # record vLLM's kwargs
    vllm_args = _args(None if spec is None else dict(spec), method, model, tokens)
    expected = _vllm_create_speculative_config()(vllm_args, "target-model", "target-parallel")
    if expected is not None:
        assert expected.pop("target_model_config") == "target-model"
        assert expected.pop("target_parallel_config") == "target-parallel"

    ours_args = _args(None if spec is None else dict(spec), method, model, tokens)
    assert compat_args.merge_spec_cli_aliases(ours_args) == expected
    # Flags are consumed, so vLLM's method (run later on the rewritten config) does not merge again.
    assert (ours_args.spec_method, ours_args.spec_model, ours_args.spec_tokens) == (None, None, None)


def test_flag_and_key_conflict_raises_like_vllm(monkeypatch):
    import vllm.engine.arg_utils as arg_utils

    monkeypatch.setattr(arg_utils, "SpeculativeConfig", lambda **kwargs: kwargs)
    with pytest.raises(ValueError) as vllm_error:
        _vllm_create_speculative_config()(_args({"num_speculative_tokens": 3}, tokens=3), None, None)
    with pytest.raises(ValueError) as ours:
        compat_args.merge_spec_cli_aliases(_args({"num_speculative_tokens": 3}, tokens=3))
    assert str(ours.value) == str(vllm_error.value)


def test_wrapper_passes_other_requests_to_vllm(monkeypatch):
    """With the hook installed, a non-sparsever request reaches vLLM's own method unchanged."""
    import vllm.engine.arg_utils as arg_utils

    from vllm_sparsever.integration.speculative import install_speculative_config_hook

    install_speculative_config_hook()
    install_speculative_config_hook()  # idempotent
    method = compat_args.engine_args_cls().create_speculative_config
    assert getattr(method, "_sparsever_wrapped", False)
    assert not getattr(method.__wrapped__, "_sparsever_wrapped", False)  # wrapped once
    monkeypatch.setattr(arg_utils, "SpeculativeConfig", lambda **kwargs: kwargs)
    out = method(_args({"method": "ngram", "num_speculative_tokens": 2}), "tm", "tp")
    assert out == {"method": "ngram", "num_speculative_tokens": 2,
                   "target_model_config": "tm", "target_parallel_config": "tp"}


def test_sparsever_flag_conflict_is_a_config_error():
    from vllm_sparsever.config import SparseverConfigError
    from vllm_sparsever.integration.speculative import _create_speculative_config

    args = _args({"method": "sparsever", "num_speculative_tokens": 3}, tokens=3)
    with pytest.raises(SparseverConfigError, match="mutually exclusive"):
        _create_speculative_config(args, lambda: pytest.fail("vLLM must not be called"), None, None)
