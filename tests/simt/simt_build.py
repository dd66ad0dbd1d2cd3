"""Build (once, cached) the test-only torch extensions that run CUDA kernel bodies on the SIMT executor.

The extensions are plain shared libraries registering ops with TORCH_LIBRARY (no pybind, no
torch/extension.h: that keeps each compile short). Ninja reuses the objects under build/simt_tests/ until a
source or included header changes.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
from torch.utils import cpp_extension

REPO = Path(__file__).resolve().parents[2]
CSRC = REPO / "csrc"
TEST_CSRC = Path(__file__).resolve().parent / "csrc"
BUILD_ROOT = Path(os.environ.get("SPARSEVER_SIMT_BUILD_DIR", REPO / "build" / "simt_tests"))

# -O2: kernels run as ordinary C++; -fno-ipa-reference keeps GCC from assuming that a function-local
# `static thread_local` (__shared__) cannot change across the opaque context switch in __syncthreads.
COMMON_CFLAGS = ["-O2", "-std=c++20", "-fno-ipa-reference", "-Wall", "-Wno-unused-function", "-Wno-unknown-pragmas", "-Wno-sign-compare"]


def _build(name: str, sources: list[str], extra_cflags: list[str] | None = None) -> None:
    build_dir = BUILD_ROOT / name
    build_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MAX_JOBS", "2")
    cpp_extension.load(
        name=name,
        sources=[str(TEST_CSRC / s) for s in sources],
        extra_cflags=COMMON_CFLAGS + (extra_cflags or []),
        extra_include_paths=[str(CSRC)],
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=bool(os.environ.get("SPARSEVER_SIMT_VERBOSE")),
    )


@functools.cache
def executor_ops(use_ucontext: bool = False):
    """torch.ops namespace with the executor's own test kernels (asm or ucontext context switch)."""
    if use_ucontext:
        _build("sparsever_simt_executor_ucontext", ["executor_tests.cpp"], ["-DSIMT_USE_UCONTEXT"])
        return torch.ops.simt_test_ucontext
    _build("sparsever_simt_executor", ["executor_tests.cpp"])
    return torch.ops.simt_test


KERNEL_SOURCES = ["attention_ops.cpp", "ffn_moe_ops.cpp"]


@functools.cache
def kernel_ops():
    """torch.ops.sparsever_simt: the product's CUDA kernel bodies run by the SIMT executor; with
    SPARSEVER_SIMT_DEVICE=cuda|cpu, the same cases on the product's own ops on that device instead."""
    device = os.environ.get("SPARSEVER_SIMT_DEVICE")
    if device:
        from device_ops import DeviceOps

        return DeviceOps(device)
    _build("sparsever_simt_kernels", KERNEL_SOURCES)
    return torch.ops.sparsever_simt
