"""What `register()` (the `vllm.general_plugins` entry point) does in every vLLM process.

vLLM calls it in the front end, the engine core, every worker (mp and Ray, every TP rank),
before the worker class is resolved; it may run several times per process, so it is idempotent.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

# When set, every process appends "pid ppid" to this file on registration (used by tests to
# check that the plugin is active in the front end, engine core and every worker).
REGISTRATION_LOG_ENV = "VLLM_SPARSEVER_REGISTRATION_LOG"

# Every VLLM_SPARSEVER_* variable the package reads (listed in docs/configuration.md), declared to
# vLLM's environment check so that it neither warns nor, under --fail-on-environ-validation, refuses.
ENVIRONMENT_VARIABLES = (
    "VLLM_SPARSEVER_HOME",
    "VLLM_SPARSEVER_ALLOW_UNTESTED_VLLM",
    "VLLM_SPARSEVER_CHECK_REFERENCE",
    "VLLM_SPARSEVER_METRICS_DIR",
    "VLLM_SPARSEVER_RAY_CPU",
    "VLLM_SPARSEVER_RAY_RESOURCE",
    "VLLM_SPARSEVER_REGISTRATION_LOG",
    "VLLM_SPARSEVER_STATS_SAMPLE_EVERY",
)

_done = False


def register_all() -> None:
    global _done
    if _done:
        return
    from vllm_sparsever.compat import check_vllm_version
    from vllm_sparsever.compat.envs import declare_environment_variables
    from vllm_sparsever.integration.speculative import install_speculative_config_hook

    # Before any hook: on a vLLM version the compat contracts were not checked against, every
    # process stops here with one clear message instead of failing somewhere inside vLLM.
    check_vllm_version()
    declare_environment_variables(ENVIRONMENT_VARIABLES)
    install_speculative_config_hook()
    from vllm_sparsever.compat.sampling import allow_min_p_and_logit_bias

    allow_min_p_and_logit_bias()  # only for SpeculativeConfigs sparsever made (compat/sampling.py)
    # Engine core (scheduler) and workers (warm-up) read the KV lookahead from VllmConfig.
    from vllm_sparsever.compat.vllm_config import reserve_extra_lookahead
    from vllm_sparsever.integration.speculative import self_draft_lookahead

    reserve_extra_lookahead(self_draft_lookahead)
    _done = True
    log_path = os.environ.get(REGISTRATION_LOG_ENV)
    if log_path:
        with open(log_path, "a") as f:
            f.write(f"{os.getpid()} {os.getppid()}\n")
    logger.debug("vllm-sparsever registered in pid %d", os.getpid())


def is_registered() -> bool:
    return _done
