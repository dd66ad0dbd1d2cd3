"""Atomic, cached model/data folders with a sha256 manifest.

A folder is *finished* when its manifest exists and every file it lists is present with the
recorded size. Builds happen in a temporary sibling directory that is renamed into place only
after the manifest is written, so an interrupted build never leaves a folder that looks
finished; a folder without a valid manifest (from an older or foreign build) is rebuilt.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

MANIFEST_NAME = "sparsever_manifest.json"
MANIFEST_FORMAT = 1
_HASH_CHUNK = 1 << 22


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def describe_files(folder: Path) -> dict[str, dict[str, Any]]:
    """sha256 and size of every file under `folder` (the manifest itself excluded)."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel == MANIFEST_NAME:
            continue
        files[rel] = {"sha256": sha256_file(path), "size": path.stat().st_size}
    return files


def read_manifest(folder: str | os.PathLike) -> dict[str, Any] | None:
    path = Path(folder) / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        return None
    return manifest


def is_finished(folder: str | os.PathLike) -> bool:
    """Cheap completeness check (sizes, not hashes): used on every call to stay fast."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest is None or not isinstance(manifest.get("files"), dict) or not manifest["files"]:
        return False
    for rel, info in manifest["files"].items():
        path = folder / rel
        if not path.is_file() or path.stat().st_size != info.get("size"):
            return False
    return True


def verify_folder(folder: str | os.PathLike) -> list[str]:
    """Recompute every sha256; returns the problems found (empty when the folder is intact)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest is None:
        return [f"{folder / MANIFEST_NAME}: missing or unreadable"]
    problems = []
    for rel, info in manifest.get("files", {}).items():
        path = folder / rel
        if not path.is_file():
            problems.append(f"{rel}: missing")
        elif sha256_file(path) != info["sha256"]:
            problems.append(f"{rel}: sha256 differs from the manifest")
    return problems


def _apply_default_permissions(folder: Path) -> None:
    """mkdtemp makes 0700 dirs and safetensors writes 0600 files: give the result the umask's modes."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [folder, *folder.rglob("*")]:
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


@contextlib.contextmanager
def _folder_lock(final: Path) -> Iterator[None]:
    """Serialise builds of the same folder across processes (two CLI runs, pytest-xdist, ...)."""
    lock_path = final.parent / f".{final.name}.lock"
    with open(lock_path, "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def build_folder(
    final: str | os.PathLike,
    produce: Callable[[Path], dict[str, Any]],
    *,
    force: bool = False,
    log: Callable[[str], None] = print,
) -> Path:
    """Create `final` by calling `produce(tmp_dir)` unless it is already finished.

    `produce` fills the temporary directory and returns extra manifest fields; the manifest
    (with the sha256 of every produced file) is written last, then the directory is renamed
    into place atomically.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    with _folder_lock(final):
        if not force and is_finished(final):
            return final
        for stale in final.parent.glob(f".{final.name}.tmp-*"):
            # Left by a build that died; we hold the lock, so nobody else is writing it.
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():
            log(f"{final} is not a finished build (no valid manifest or files missing): rebuilding")
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            extra = produce(tmp)
            manifest = {
                "format": MANIFEST_FORMAT,
                "name": final.name,
                "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                **extra,
                "files": describe_files(tmp),
            }
            (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
            _apply_default_permissions(tmp)
            if final.exists():
                # Move the unfinished folder aside first: rename onto a non-empty dir fails.
                trash = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-old-", dir=final.parent))
                os.replace(final, trash / "old")
                shutil.rmtree(trash, ignore_errors=True)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final
