"""The vLLM version gate: checked versions pass, others fail at registration unless overridden."""

import logging

import pytest

from vllm_sparsever import compat


def test_installed_vllm_is_a_checked_version():
    assert compat.public_version(compat.installed_vllm_version()) in compat.CHECKED_VLLM_VERSIONS
    compat.check_vllm_version()  # must not raise


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu"])
def test_checked_version_with_or_without_local_part_passes(version, monkeypatch):
    monkeypatch.delenv(compat.ALLOW_UNTESTED_VLLM_ENV, raising=False)
    compat.check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.33.0", "0.31.2+cpu", "0.32.0rc1", "0.32.1.dev3"])
def test_unknown_version_raises_naming_versions_and_override(version, monkeypatch):
    monkeypatch.delenv(compat.ALLOW_UNTESTED_VLLM_ENV, raising=False)
    with pytest.raises(RuntimeError) as info:
        compat.check_vllm_version(version)
    message = str(info.value)
    assert version in message
    assert all(v in message for v in compat.CHECKED_VLLM_VERSIONS)
    assert compat.ALLOW_UNTESTED_VLLM_ENV in message


def test_override_warns_instead_of_raising(monkeypatch, caplog):
    monkeypatch.setenv(compat.ALLOW_UNTESTED_VLLM_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="vllm_sparsever"):
        compat.check_vllm_version("9.9.9")
    assert any("9.9.9" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_registration_fails_on_an_unknown_vllm(monkeypatch):
    from vllm_sparsever.integration import registration

    monkeypatch.delenv(compat.ALLOW_UNTESTED_VLLM_ENV, raising=False)
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: "9.9.9")
    monkeypatch.setattr(registration, "_done", False)
    with pytest.raises(RuntimeError, match="9.9.9"):
        registration.register_all()
    assert not registration.is_registered()
