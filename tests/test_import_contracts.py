"""The package's floors hold: import-linter's contracts (pyproject.toml, [tool.importlinter]) and
vLLM's internals reached only through vllm_sparsever.compat."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vllm_sparsever"

# vLLM's public API, which any module may import; everything else of vLLM goes through compat/.
PUBLIC_VLLM = {
    "vllm": {"LLM", "SamplingParams"},
    "vllm.platforms": {"current_platform"},
    "vllm.distributed": {"get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size",
                         "tensor_model_parallel_all_reduce", "tensor_model_parallel_all_gather"},
}


def test_import_linter_contracts_are_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    if not lint.exists():
        pytest.fail(f"import-linter is not installed next to {sys.executable} (requirements/dev.txt)")
    done = subprocess.run([str(lint), str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout and " kept" in done.stdout


def vllm_imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) of every `import vllm...` / `from vllm... import name` in a file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, "*") for a in node.names if a.name.split(".")[0] == "vllm"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "vllm":
            found += [(node.lineno, node.module, a.name) for a in node.names]
    return found


def test_vllm_internals_only_through_compat():
    outside = [p for p in PACKAGE.rglob("*.py") if "compat" not in p.relative_to(PACKAGE).parts]
    assert len(outside) > 50  # the walk found the package
    private = [f"{p.relative_to(ROOT)}:{line}: {module}.{name}" for p in outside
               for line, module, name in vllm_imports(p) if name not in PUBLIC_VLLM.get(module, ())]
    assert not private, "vLLM symbols outside its public API, imported outside compat/:\n" + "\n".join(private)


def evict_internals_read(path: Path) -> list[int]:
    """Lines of a file that read the EVICT engine behind its facade (`EvictPolicy._evict`)."""
    return [node.lineno for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.Attribute) and node.attr == "_evict"]


def test_evicts_members_are_read_only_inside_adaptive():
    """Outside adaptive/, EVICT is asked through `adaptive.policy.EvictPolicy` only (import-linter
    keeps its engine's modules out of reach; this keeps its engine object out of reach)."""
    outside = [p for p in PACKAGE.rglob("*.py") if "adaptive" not in p.relative_to(PACKAGE).parts]
    found = [f"{p.relative_to(ROOT)}:{line}" for p in outside for line in evict_internals_read(p)]
    assert not found, "EVICT's engine read outside adaptive/:\n" + "\n".join(found)


def test_the_evict_check_sees_a_read(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text("def f(policy):\n    return policy._evict.stats\n")
    assert evict_internals_read(sample) == [2]


def test_the_check_sees_a_private_import(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text("def f():\n    from vllm.v1.worker import gpu_model_runner\n    from vllm import LLM\n")
    assert vllm_imports(sample) == [(2, "vllm.v1.worker", "gpu_model_runner"), (3, "vllm", "LLM")]


def test_runner_batch_internals_only_through_compat():
    # vLLM's InputBatch is runner-private: drafters and the runner read it through compat.runner.
    outside = [p for p in PACKAGE.rglob("*.py") if "compat" not in p.relative_to(PACKAGE).parts]
    uses = [f"{p.relative_to(ROOT)}:{node.lineno}" for p in outside
            for node in ast.walk(ast.parse(p.read_text(), str(p)))
            if isinstance(node, ast.Attribute) and node.attr == "input_batch"]
    assert not uses, "runner.input_batch read outside compat/:\n" + "\n".join(uses)


def runner_references(path: Path) -> list[int]:
    """Lines where a module names a runner: a parameter, variable or attribute `runner` / `_runner`."""
    names = {"runner", "_runner"}
    return [node.lineno for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if (isinstance(node, ast.arg) and node.arg in names) or (isinstance(node, ast.Name) and node.id in names)
            or (isinstance(node, ast.Attribute) and node.attr in names)]


def test_proposers_never_hold_the_runner(tmp_path):
    # Proposers get a step.TargetView at load (the part of the runner drafting may use).
    drafting = sorted((PACKAGE / "drafting").glob("*.py"))
    assert len(drafting) > 10
    uses = [f"{p.relative_to(ROOT)}:{line}" for p in drafting for line in runner_references(p)]
    assert not uses, "the runner named in drafting/ (use the TargetView proposers load with):\n" + "\n".join(uses)
    sample = tmp_path / "m.py"
    sample.write_text("def load(self, runner):\n    self._runner = runner\n")
    assert runner_references(sample) == [1, 2, 2]
