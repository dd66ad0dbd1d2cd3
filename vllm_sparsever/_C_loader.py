"""Import the ISA build of the extension this CPU can run (AVX-512 where present, else AVX2)."""

import importlib
import logging

import torch

logger = logging.getLogger(__name__)

_loaded: str | None = None


def load_extension() -> str:
    """Load the `sparsever` torch library once per process; return the module name loaded."""
    global _loaded
    if _loaded is None:
        capability = torch.backends.cpu.get_cpu_capability()
        candidates = ["vllm_sparsever._C_avx512", "vllm_sparsever._C"] if capability == "AVX512" else ["vllm_sparsever._C"]
        last_error: Exception | None = None
        for name in candidates:
            try:
                importlib.import_module(name)
                _loaded = name
                break
            except ImportError as e:  # missing build: try the baseline one
                last_error = e
        if _loaded is None:
            raise ImportError(
                "vllm_sparsever's extension is not built; run `pip install --no-build-isolation .` (`-e .` in a development checkout)"
            ) from last_error
        # A CUDA torch with a CPU-only build of this extension (no device query here: querying CUDA
        # before vLLM forks its workers can break them).
        if torch.version.cuda and not torch._C._dispatch_has_kernel_for_dispatch_key(
                "sparsever::block_sparse_tree_attention", "CUDA"):
            logger.warning("%s has no CUDA kernels but torch is a CUDA build: the sparse paths will fail on CUDA "
                           "tensors; rebuild with SPARSEVER_TARGET_DEVICE=cuda and nvcc on PATH", _loaded)
    return _loaded
