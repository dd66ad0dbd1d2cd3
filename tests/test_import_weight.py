"""The plugin loads only what serving needs in every vLLM process (front end, engine core, workers).

vLLM runs `vllm_sparsever.register()` in each of its processes, so everything the serving path
imports is paid at every start. Model builders, data builders, calibration and the benchmark code
must never be imported there; third-party packages the project uses elsewhere (hypothesis, tqdm,
matplotlib, transformers) may only be there because vLLM itself imports them.

Each check runs in a fresh interpreter that first imports what vLLM's own process imports anyway
(the baseline, with plugins disabled so the installed entry point does not run early), then the
plugin. Timing of the same steps: `bench/import_time.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vllm_sparsever.integration import WORKER_MODULES

ROOT = Path(__file__).resolve().parent.parent

# Each check imports vLLM's front end or worker modules in a fresh interpreter (~10-25 s).
pytestmark = pytest.mark.slow

# Never imported by a serving process, whatever vLLM imports.
FORBIDDEN_OWN = ("vllm_sparsever.models", "vllm_sparsever.data", "vllm_sparsever.store", "vllm_sparsever.offline",
                 "bench")
# Not imported by the plugin beyond what vLLM's own modules already imported.
FORBIDDEN_THIRD_PARTY = ("hypothesis", "tqdm", "matplotlib", "transformers")


_REPORT = textwrap.dedent(
    """
    import json, sys

    def report(baseline, **extra):
        own, third = json.loads(sys.argv[1]), json.loads(sys.argv[2])
        loaded = set(sys.modules)
        def matches(name, prefixes):
            return any(name == p or name.startswith(p + ".") for p in prefixes)
        print("REPORT " + json.dumps({
            "own": sorted(m for m in loaded if matches(m, own)),
            "third_party_added": sorted(m for m in loaded - baseline if matches(m, third)),
            "plugin_modules": sorted(m for m in loaded if m.startswith("vllm_sparsever")),
            **extra,
        }))
    """
)

# Front end (and engine core): vLLM's argument handling, a plain config build, then the plugin
# and the sparsever config build, which runs the plugin's validation and config mapping.
_FRONT_END = _REPORT + textwrap.dedent(
    """
    target, draft = sys.argv[3], sys.argv[4]
    from vllm.engine.arg_utils import EngineArgs
    EngineArgs(model=target, max_model_len=512).create_engine_config()
    baseline = set(sys.modules)

    import vllm_sparsever
    vllm_sparsever.register()
    config = EngineArgs(
        model=target, max_model_len=512,
        speculative_config={"method": "sparsever", "model": draft, "num_speculative_tokens": 2,
                            "attention": {"enabled": True}, "ffn": {"enabled": True}},
    ).create_engine_config()
    from vllm_sparsever.integration.speculative import WORKER_CLS, sparsever_config_from_vllm
    sparsever = sparsever_config_from_vllm(config)
    report(baseline, worker_cls=config.parallel_config.worker_cls,
           attention_enabled=sparsever.attention.enabled, ffn_enabled=sparsever.ffn.enabled)
    """
)

# Worker: vLLM's own worker and runner modules for this platform, then what the plugin's worker
# imports at start.
_WORKER = _REPORT + textwrap.dedent(
    """
    modules = json.loads(sys.argv[3])
    from vllm.platforms import current_platform
    if current_platform.is_cpu():
        import vllm.v1.worker.cpu_model_runner, vllm.v1.worker.cpu_worker
    else:
        import vllm.v1.worker.gpu_model_runner, vllm.v1.worker.gpu_worker
    baseline = set(sys.modules)

    import importlib
    import vllm_sparsever
    vllm_sparsever.register()
    for name in modules:
        importlib.import_module(name)
    report(baseline)
    """
)


def _run(script: str, *args: str, tmp_path: Path) -> dict:
    # Plugins off for the baseline: the plugin registers itself explicitly after it.
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_PLUGINS="none-for-import-weight-baseline")
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(FORBIDDEN_OWN), json.dumps(FORBIDDEN_THIRD_PARTY), *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    assert len(lines) == 1, proc.stdout[-3000:]
    return json.loads(lines[0][len("REPORT "):])


def _assert_light(report: dict) -> None:
    assert report["own"] == [], f"serving path imported {report['own']}"
    assert report["third_party_added"] == [], (
        f"the plugin imported packages vLLM does not: {report['third_party_added']}")


def test_worker_imports_only_the_serving_path(tmp_path):
    report = _run(_WORKER, json.dumps(list(WORKER_MODULES)), tmp_path=tmp_path)
    # The report sees the modules it should judge (a check on the check).
    assert set(WORKER_MODULES) <= set(report["plugin_modules"]), report["plugin_modules"]
    _assert_light(report)


def test_front_end_config_build_imports_only_the_serving_path(tiny_target, tiny_draft, tmp_path):
    report = _run(_FRONT_END, str(tiny_target), str(tiny_draft), tmp_path=tmp_path)
    # The sparsever config was really built through the plugin's hook.
    assert report["worker_cls"] == "vllm_sparsever.integration.worker.SparseverWorker"
    assert report["attention_enabled"] and report["ffn_enabled"]
    assert "vllm_sparsever.integration.speculative" in report["plugin_modules"]
    _assert_light(report)


def test_the_check_flags_a_forbidden_import(tmp_path):
    """Negative control: the same script with calibration and hypothesis imported reports both."""
    report = _run(_WORKER, json.dumps([*WORKER_MODULES, "vllm_sparsever.offline.calibration", "hypothesis"]),
                  tmp_path=tmp_path)
    assert "vllm_sparsever.offline.calibration" in report["own"]
    assert "hypothesis" in report["third_party_added"]
