"""The SIMT suite's cases run on the product's own ops: an adapter with the SIMT ops' call signature.

`SPARSEVER_SIMT_DEVICE=cuda` (or `cpu`) makes `simt_build.kernel_ops()` return this adapter instead of
the executor build, so the same hypothesis cases check `torch.ops.sparsever.*` on a GPU (bench/gpu/check.py
runs them so). Per call it copies every tensor argument to the device with its strides (the KV caches are
strided views of one storage), drops the SIMT-only trailing arguments (num_sms, forced_splits: the real
launcher reads the SM count and picks the split itself; attention's tensor_cores=False becomes
SPARSEVER_CUDA_ATTENTION=cuda_cores for the call), and copies the op's mutated outputs back into
the caller's CPU tensors.
"""

from __future__ import annotations

import os

import torch


def to_device_strided(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device` with the same sizes, strides and storage offset (the whole storage is copied)."""
    if t.device == device:
        return t
    numel = t.untyped_storage().nbytes() // t.element_size()
    flat = torch.as_strided(t, (numel,), (1,), 0).to(device)
    return torch.as_strided(flat, t.shape, t.stride(), t.storage_offset())


class DeviceOps:
    """Callable like `torch.ops.sparsever_simt`; runs `torch.ops.sparsever` on `device`."""

    def __init__(self, device: str) -> None:
        import vllm_sparsever._custom_ops  # noqa: F401 (loads the extension)

        self.device = torch.device(device)

    def __getattr__(self, name: str):
        op = getattr(torch.ops.sparsever, name).default
        schema = op._schema.arguments
        written = [i for i, a in enumerate(schema) if a.alias_info is not None and a.alias_info.is_write]

        def call(*args):
            extra = args[len(schema):]  # the SIMT ops' extra launch arguments
            args = args[: len(schema)]
            cuda_cores = name == "block_sparse_tree_attention" and len(extra) >= 3 and not extra[2]
            moved = [to_device_strided(a, self.device) if isinstance(a, torch.Tensor) else a for a in args]
            if cuda_cores:
                os.environ["SPARSEVER_CUDA_ATTENTION"] = "cuda_cores"
            try:
                op(*moved)
            finally:
                if cuda_cores:
                    os.environ.pop("SPARSEVER_CUDA_ATTENTION", None)
            for i in written:
                if moved[i] is not args[i]:
                    args[i].copy_(moved[i].cpu())

        return call
