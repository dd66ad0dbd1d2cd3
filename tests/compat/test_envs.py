"""sparsever's environment variables pass vLLM's environment check (compat/envs.py)."""

import os
import re
from pathlib import Path

import pytest

import vllm_sparsever
from vllm_sparsever.integration.registration import ENVIRONMENT_VARIABLES


def test_declared_variables_pass_vllms_environment_check(monkeypatch):
    from vllm import envs
    from vllm.platforms import current_platform

    from vllm_sparsever.compat.envs import declare_environment_variables

    declare_environment_variables(ENVIRONMENT_VARIABLES)
    assert callable(envs.environment_variables["VLLM_SPARSEVER_HOME"])
    for name in list(os.environ):  # what vLLM itself left undeclared (its CPU worker sets VLLM_DIST_IDENT)
        if name.startswith("VLLM_") and name not in envs.environment_variables:
            monkeypatch.delenv(name)
    monkeypatch.setenv("VLLM_SPARSEVER_HOME", "/tmp/somewhere")
    assert envs.environment_variables["VLLM_SPARSEVER_HOME"]() == "/tmp/somewhere"
    current_platform.validate_environ(hard_fail=True)  # --fail-on-environ-validation: no error
    # The check is live: an undeclared VLLM_* variable still fails it.
    monkeypatch.setenv("VLLM_SPARSEVER_NOT_A_VARIABLE", "1")
    with pytest.raises(ValueError, match="VLLM_SPARSEVER_NOT_A_VARIABLE"):
        current_platform.validate_environ(hard_fail=True)


def test_every_variable_the_package_reads_is_declared():
    root = Path(vllm_sparsever.__file__).parent
    used = set()
    for path in root.rglob("*.py"):
        used |= set(re.findall(r"VLLM_SPARSEVER_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    assert used and used <= set(ENVIRONMENT_VARIABLES), sorted(used - set(ENVIRONMENT_VARIABLES))
