"""What every benchmark's record holds beside its numbers: where results go, the machine, the versions
(with the commit) and the CPU binding. The machine, versions and binding are bench/harness.py's, so a
kernel run and an end-to-end run describe a machine alike."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harness import RESULTS, ROOT, binding_env, commit, machine, package_versions

__all__ = ["RESULTS", "ROOT", "binding_env", "hardware", "save_results", "versions"]


def hardware() -> dict[str, Any]:
    """harness.machine() without the binding and versions (a record keeps those under their own keys),
    plus the keys older records and the summaries that read them use ('Model name', 'nproc',
    'loadavg_1_5_15', 'avx512f')."""
    info = {k: v for k, v in machine().items() if k not in ("binding", "versions")}
    return {"Model name": info.get("cpu"), "nproc": info["cores"], "loadavg_1_5_15": info["loadavg"],
            "avx512f": (info.get("isa") or {}).get("avx512f"), **info}


def versions() -> dict[str, Any]:
    """The installed versions and this checkout's commit."""
    return {**package_versions(), "git": commit()}


def save_results(base: Path, record: dict[str, Any], lines: list[str]) -> None:
    """Write `record` to BASE.json and the report `lines` to BASE.md (the whole name kept: a tag may
    hold dots), and print the report."""
    Path(f"{base}.json").write_text(json.dumps(record, indent=1, default=str))
    Path(f"{base}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"results: {base}.md / .json")
