"""The wheel a user gets from a clean clone holds the whole package, its extension and its entry points.

Built the way the README tells GPU users to install (`pip install --no-build-isolation .`,
non-editable), CUDA aside: `pip wheel --no-build-isolation --no-deps` with the venv's python and
`SPARSEVER_TARGET_DEVICE=cpu`. An editable install hides a missing package (it imports from the
source tree), so the wheel is opened and then installed into a temporary target and imported from
there, in a fresh process outside the repository.

The build runs on a copy of the files a clone would hold: tracked files plus untracked ones that
are not ignored (what the next commit can contain), with their working-tree contents. Ignored
files (the in-place `_C*.so`, `build/`, `*.egg-info`) stay out, so the extension in the wheel is
the one this build compiled, and a module missing from git fails here as it would for a user.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "vllm_sparsever"

pytestmark = pytest.mark.slow

# What a vLLM process imports from the plugin to serve (front end, engine core, worker).
SERVING_MODULES = [
    "vllm_sparsever",
    "vllm_sparsever.config",
    "vllm_sparsever.plan",
    "vllm_sparsever.forward_scope",
    "vllm_sparsever.metrics",
    "vllm_sparsever._C_loader",
    "vllm_sparsever._custom_ops",
    "vllm_sparsever.integration.registration",
    "vllm_sparsever.integration.speculative",
    "vllm_sparsever.integration.model_runner",
    "vllm_sparsever.integration.worker",
    "vllm_sparsever.verification.support",
    "vllm_sparsever.verification.sparse.profile",
    "vllm_sparsever.verification.sparse.setup",
    "vllm_sparsever.verification.sparse.runtime",
    "vllm_sparsever.verification.sparse.attention",
    "vllm_sparsever.verification.sparse.ffn",
    "vllm_sparsever.verification.sparse.moe",
    "vllm_sparsever.verification.lossless.tree_acceptance",
    "vllm_sparsever.verification.lossless.logits_params",
    "vllm_sparsever.verification.lossless.linear_kernel",
    "vllm_sparsever.verification.lossless.kv_layout",
]


def _clone_file_list() -> list[str]:
    """Files a clone of the working tree would hold (tracked + untracked, not ignored), existing."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT, capture_output=True, check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.fail(f"the packaging test builds from the git file list; {ROOT} is not a git checkout: {e}")
    files = [f for f in out.decode().split("\0") if f]
    return [f for f in files if (ROOT / f).is_file()]  # tracked but deleted in the work tree: gone


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(wheel path, source copy, python modules of the source's package) built once per module."""
    work = tmp_path_factory.mktemp("packaging")
    src = work / "src"
    files = _clone_file_list()
    for rel in files:
        dest = src / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dest)
    assert not list((src / PACKAGE).glob("_C*.so")), "an ignored in-place extension leaked into the copy"

    wheel_dir = work / "wheels"
    env = dict(os.environ, SPARSEVER_TARGET_DEVICE="cpu", MAX_JOBS="2")
    env.pop("PYTHONPATH", None)  # the build must not see the source tree's package
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
         "-w", str(wheel_dir), str(src)],
        cwd=work, env=env, capture_output=True, text=True, timeout=1800,
    )
    assert proc.returncode == 0, f"wheel build failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    wheels = list(wheel_dir.glob("vllm_sparsever-*.whl"))
    assert len(wheels) == 1, f"expected one wheel, got {wheels}"
    modules = sorted(f for f in files if f.startswith(f"{PACKAGE}/") and f.endswith(".py"))
    return wheels[0], src, modules


def test_wheel_holds_every_module_and_both_extensions(built):
    wheel, _, modules = built
    assert f"{PACKAGE}/verification/sparse/attention.py" in modules  # the list is the real one
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    missing = [m for m in modules if m not in names]
    assert not missing, f"source modules missing from {wheel.name}: {missing}"
    # Both ISA builds: the loader picks AVX-512 where the CPU has it, else the baseline one.
    for module in ("_C", "_C_avx512"):
        pattern = re.compile(rf"{PACKAGE}/{module}\.[^/]*\.so$")
        assert [n for n in names if pattern.match(n)], f"{module} extension missing from {wheel.name}"
    # Only the package and its metadata: no tests/, bench/ or build leftovers at the top level.
    top_level = {n.split("/")[0] for n in names}
    assert top_level == {PACKAGE, f"vllm_sparsever-{_version(wheel)}.dist-info"}, top_level


def _version(wheel: Path) -> str:
    return wheel.name.split("-")[1]


def test_wheel_declares_the_vllm_plugin_and_the_console_script(built):
    wheel, _, _ = built
    with zipfile.ZipFile(wheel) as zf:
        text = zf.read(f"vllm_sparsever-{_version(wheel)}.dist-info/entry_points.txt").decode()
    entry_points = configparser.ConfigParser()
    entry_points.read_string(text)
    assert dict(entry_points["vllm.general_plugins"]) == {"sparsever": "vllm_sparsever:register"}
    assert dict(entry_points["vllm.platform_plugins"]) == {
        "sparsever_ray_cpu": "vllm_sparsever.integration.ray_cpu:platform_plugin"}
    assert entry_points["console_scripts"]["vllm-sparsever"] == "vllm_sparsever.cli:main"


# Runs in a fresh interpreter with only the installed target on PYTHONPATH, cwd outside the repo.
_INSTALLED_CHECK = textwrap.dedent(
    """
    import importlib, importlib.metadata, json, sys
    from pathlib import Path

    target = Path(sys.argv[1]).resolve()
    modules = json.loads(sys.argv[2])

    def from_target(module):
        return Path(module.__file__).resolve().is_relative_to(target)

    for name in modules:
        module = importlib.import_module(name)
        assert from_target(module), f"{name} imported from {module.__file__}, not from {target}"

    from vllm_sparsever._C_loader import load_extension
    loaded = load_extension()
    assert from_target(sys.modules[loaded]), sys.modules[loaded].__file__

    # The extension from the wheel computes: keep == I is the dense SwiGLU MLP.
    import torch
    import torch.nn.functional as F
    from vllm_sparsever import _custom_ops as ops
    torch.manual_seed(0)
    tokens, hidden, inter = 3, 64, 32
    x = torch.randn(tokens, hidden)
    w_gate_up = torch.randn(2 * inter, hidden) / hidden**0.5
    w_down_t = torch.randn(inter, hidden) / inter**0.5
    out, selected = ops.topk_swiglu_ffn(x, w_gate_up, w_down_t,
                                        torch.tensor([0, tokens], dtype=torch.int32), inter)
    dense = (F.silu(x @ w_gate_up[:inter].t()) * (x @ w_gate_up[inter:].t())) @ w_down_t
    torch.testing.assert_close(out, dense, rtol=1e-4, atol=1e-4)
    assert selected.tolist() == [list(range(inter))], selected

    # vLLM finds the plugin through the installed metadata, and loading it registers the plugin.
    ours = [ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins")
            if Path(ep.dist.locate_file("")).resolve() == target]
    assert [(ep.name, ep.value) for ep in ours] == [("sparsever", "vllm_sparsever:register")], ours
    import vllm_sparsever
    assert ours[0].load() is vllm_sparsever.register
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    from vllm_sparsever.integration.registration import is_registered
    assert is_registered(), "vLLM's plugin loader did not run vllm_sparsever.register"
    print("INSTALLED-OK", loaded)
    """
)


def test_installed_wheel_serves_from_its_own_files(built, tmp_path):
    wheel, _, modules = built
    target = tmp_path / "site"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_PLUGINS")}
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Every source module landed in the target, not just the ones imported below.
    installed = {str(p.relative_to(target)) for p in (target / PACKAGE).rglob("*.py")}
    assert set(modules) <= installed, sorted(set(modules) - installed)

    env["PYTHONPATH"] = str(target)
    proc = subprocess.run(
        [sys.executable, "-c", _INSTALLED_CHECK, str(target), json.dumps(SERVING_MODULES)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "INSTALLED-OK vllm_sparsever._C" in proc.stdout

    # The console script the wheel installs runs against the installed package.
    script = target / "bin" / "vllm-sparsever"
    assert script.is_file(), sorted(p.name for p in (target / "bin").iterdir())
    proc = subprocess.run([sys.executable, str(script), "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "usage" in proc.stdout.lower(), proc.stdout + proc.stderr


def test_setup_honours_cuda_archs_and_cmake_args():
    import runpy

    helpers = runpy.run_path(str(Path(__file__).resolve().parents[1] / "setup.py"), run_name="setup_helpers")
    args = helpers["cmake_args_from_env"]({"SPARSEVER_CUDA_ARCHS": "90", "CMAKE_ARGS": "-DFOO='a b' -G Ninja"})
    assert args == ["-DSPARSEVER_CUDA_ARCHS=90", "-DFOO=a b", "-G", "Ninja"]
    assert helpers["cmake_args_from_env"]({}) == []


def test_cuda_build_without_nvcc_fails_loudly(tmp_path):
    """CMake asked for CUDA kernels (SPARSEVER_TARGET_DEVICE=cuda) stops when there is no CUDA compiler,
    instead of building CPU-only modules that fail on the first CUDA tensor."""
    import subprocess

    import torch

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        ["cmake", "-S", str(root), "-B", str(tmp_path), f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
         f"-DPython_EXECUTABLE={sys.executable}", "-DSPARSEVER_TARGET_DEVICE=cuda",
         "-DCMAKE_CUDA_COMPILER=/nonexistent/nvcc"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "no CUDA compiler" in proc.stdout + proc.stderr or "CMAKE_CUDA_COMPILER" in proc.stdout + proc.stderr
