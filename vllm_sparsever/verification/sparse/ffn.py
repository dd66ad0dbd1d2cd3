"""Top-k FFN neuron gating on verify steps: one neuron set per request, shared by its draft tokens.

After the target loads, every SwiGLU MLP (`gate_up_proj` + `SiluAndMul` + `down_proj`: Llama,
Qwen2, Mistral, ...) is wrapped by `SparseSwiGLUMLP`. Its forward is one opaque custom op
(`sparsever_verify::swiglu_mlp`), so a torch.compile graph reads each step's plan instead of
freezing the branch at trace time (the pattern of vLLM's `unified_attention_with_output`).

On a verify step the op scores neurons by the summed |silu(gate)| of each request's verify tokens
and reads the up/down rows of the top `keep_ratio * I` neurons only (`topk_swiglu_ffn`). Other
tokens of the step, and every decode/prefill step, run every neuron (the stock MLP; with "shared"
weights, see below).

Weights: the op needs the gate projection, the up rows [I, H] and the transposed down projection
[I, H]. vLLM-CPU normally repacks linear weights for oneDNN and frees them. While the target loads,
`keep_mlp_weights(mode)` changes that for the MLP linears: "copy" (default) lets vLLM pack them as
usual (dense steps stay stock) and keeps the plain tensors for the sparse path (+1x MLP weights);
"shared" skips the packing and `down_proj.weight` becomes a transposed view of the [I, H] tensor: no
extra memory. Dense steps then run on the plain weights: up to `shared_dense_op_max_tokens` tokens
through the same op at keep = I (every neuron), beyond that (prefill) torch's linear, which reads plain
weights at 0.3-0.7x of the packed path's speed at 1-16 tokens on CPU (docs/kernels.md).

Gate (`ffn.gate`): "stock" hands the gate rows to vLLM's own dense CPU linear as a projection of
their own (`stock_cpu_linear`, packed; with "copy" weights the plain gate rows are then dropped), so
the dense gate every verify step needs runs on the stock packed GEMM and `topk_swiglu_ffn_gated`
reads only the kept up/down rows (per MLP on a Zen 5 EPYC: 6-14% faster on Qwen-1.5B, mostly faster
on Qwen-0.5B, 0-8% slower on SmolLM2's small gate; docs/kernels.md); "kernel" lets
`topk_swiglu_ffn` stream the plain gate rows itself; "auto" chooses by the gate rows' size
(FFN_STOCK_GATE_MIN_BYTES), and is "kernel" with "shared" weights (no second gate copy).
"input_sparse" is approximate (TEAL-style): `input_sparse_gate` computes the gate from each request's
top `gate_input_keep_ratio` of hidden channels by summed |x|, reading only those rows of a transposed
gate copy [H, I] (which replaces the plain gate rows with "copy" weights); `topk_swiglu_ffn_gated`
then selects and multiplies with that gate.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator

import torch
from torch import nn

from vllm_sparsever import _custom_ops as ops
from vllm_sparsever.config import FFN_STOCK_GATE_MIN_BYTES
from vllm_sparsever.compat.linear import (
    cpu_gemm_dispatch_override,
    layer_prefix,
    stock_cpu_linear,
    use_plain_cpu_linear,
)
from vllm_sparsever.compat.worker import is_cpu_platform
from vllm_sparsever.forward_scope import current_plan
from vllm_sparsever.plan import TokenGroups
from vllm_sparsever.verification.sparse.op_modules import OpModuleRegistry
from vllm_sparsever.verification.sparse.runtime import (
    SparsePathUnavailable,
    SparseVerificationRuntime,
    get_runtime,
    layer_index_of,
)

logger = logging.getLogger("vllm_sparsever")

_MLP_LINEAR_SUFFIXES = (".mlp.gate_up_proj", ".mlp.down_proj")

# the custom op finds its module here (ops cannot take modules)
LAYERS: OpModuleRegistry["SparseSwiGLUMLP"] = OpModuleRegistry()


@torch.library.custom_op("sparsever_verify::swiglu_mlp", mutates_args=())
def _swiglu_mlp_op(x: torch.Tensor, layer_key: str) -> torch.Tensor:
    return LAYERS[layer_key].forward_impl(x)


@_swiglu_mlp_op.register_fake
def _(x: torch.Tensor, layer_key: str) -> torch.Tensor:
    return torch.empty_like(x)


class SparseSwiGLUMLP(nn.Module):
    """A SwiGLU MLP that verifies with one top-k neuron set per request."""

    def __init__(self, mlp: nn.Module, prefix: str, layer_idx: int, gate: str = "kernel",
                 weights: str = "copy", dense_kernel: str = "vllm") -> None:
        super().__init__()
        self.mlp = mlp
        self.prefix = prefix
        self.layer_idx = layer_idx
        gate_up, down = mlp.gate_up_proj, mlp.down_proj
        w_gate_up = plain_weight(gate_up)
        self.intermediate = inter = w_gate_up.shape[0] // 2
        self.gate = resolve_gate(gate, w_gate_up[:inter], weights)
        # "stock": the dense gate on the target's own linear for the gate rows, the op reads the
        # kept up/down rows; "kernel": the op streams the plain gate rows too; "input_sparse": the
        # gate from the top input channels' rows of a transposed gate copy [H, I].
        self.gate_linear = None
        self.w_gate_t = None
        self.w_gate_up = w_gate_up
        self.w_up = w_gate_up[inter:]
        rt = get_runtime()
        # Test hook (check_reference): the plain gate rows, to check the stock linear's gate too.
        self._w_gate_check = w_gate_up[:inter] if rt is not None and rt.check_reference else None
        if self.gate == "stock" and not is_cpu_platform():
            self.gate_linear = lambda x, w=w_gate_up[:inter]: torch.nn.functional.linear(x, w)
        elif self.gate == "stock":
            # vLLM-CPU packs a copy of the gate rows; with "copy" weights the plain gate rows go.
            self.gate_linear = stock_cpu_linear(w_gate_up[:inter].clone())
            self._drop_plain_gate_up(gate_up)
        if self.gate == "input_sparse":
            # A channel's gate weights one contiguous row; with "copy" weights it replaces the plain
            # gate rows (+1x MLP weights as before), with "shared" it is extra (+1/3x).
            self.w_gate_t = w_gate_up[:inter].t().contiguous()
            self._drop_plain_gate_up(gate_up)
        # [I, H]: a neuron's output weights are one contiguous row, read only if it is kept.
        w_down_t = plain_weight(down).detach().t().contiguous()
        if hasattr(down, "_sparsever_plain_weight"):
            del down._sparsever_plain_weight  # packed copy serves dense steps; keep only [I, H]
        else:
            down.weight = nn.Parameter(w_down_t.t(), requires_grad=False)
        self.w_down_t = w_down_t
        # ffn.dense_kernel "sparsever" ("shared" weights on CPU): the op serves dense steps of few tokens too.
        self.dense_op_max_tokens = (shared_dense_op_max_tokens(w_down_t.dtype)
                                    if dense_kernel == "sparsever" and weights == "shared" and is_cpu_platform() else 0)
        self.reduce_results = bool(getattr(down, "reduce_results", False)) and (
            getattr(down, "tp_size", 1) > 1
        )
        self.key = LAYERS.add(prefix, self)

    def _drop_plain_gate_up(self, gate_up: nn.Module) -> None:
        """With "copy" weights: the op needs only the up rows of the plain copy (vLLM's packed
        weight serves dense steps)."""
        if hasattr(gate_up, "_sparsever_plain_weight"):
            self.w_up = self.w_gate_up[self.intermediate:].clone()
            self.w_gate_up = None
            del gate_up._sparsever_plain_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.sparsever_verify.swiglu_mlp(x, self.key)

    def forward_impl(self, x: torch.Tensor) -> torch.Tensor:
        plan, rt = current_plan(), get_runtime()
        if (plan is None or rt is None or not rt.ffn.enabled or plan.groups is None
                or len(plan.requests) > rt.ffn.max_verify_requests):
            return self._dense(x)
        out = rt.run_sparse("ffn", lambda: self._sparse(x, plan.groups, rt))
        return self.mlp(x) if out is None else out  # after a run-time problem: the stock MLP

    def dense_uses_op(self, num_tokens: int) -> bool:
        """Whether a dense step of `num_tokens` tokens runs the op at keep = I (else the stock MLP)."""
        return 0 < num_tokens <= self.dense_op_max_tokens

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        """Every neuron: the stock MLP, or with "shared" weights on CPU and few tokens the op at
        keep = I over the plain weights (faster there than torch's linear on them)."""
        n = x.shape[0]
        if x.ndim != 2 or not self.dense_uses_op(n):
            return self.mlp(x)
        gsl = torch.tensor([0, n], dtype=torch.int32)
        if self.gate_linear is not None:  # the packed gate rows, as on verify steps
            partial, _ = ops.topk_swiglu_ffn_gated(x, self.gate_linear(x), self.w_up, self.w_down_t, gsl,
                                                   self.intermediate)
        else:  # "shared" keeps the plain gate rows whatever the gate
            partial, _ = ops.topk_swiglu_ffn(x, self.w_gate_up, self.w_down_t, gsl, self.intermediate)
        return self._reduce(partial)

    def _sparse(self, x: torch.Tensor, groups: TokenGroups, rt: SparseVerificationRuntime) -> torch.Tensor | None:
        keep = min(self.intermediate, max(1, math.ceil(rt.ffn_keep_ratio(self.layer_idx) * self.intermediate)))
        if keep >= self.intermediate:
            return self._dense(x)
        if x.ndim != 2 or x.shape[0] < groups.num_tokens:
            raise SparsePathUnavailable("shape_mismatch", f"hidden states {tuple(x.shape)} vs {groups.num_tokens} tokens")
        all_verify = groups.all_tokens_verify and x.shape[0] == groups.num_tokens
        xv = x if all_verify else x[groups.token_index]
        # This rank's share (its neurons only under tensor parallelism), then the all-reduce
        # down_proj would do.
        gsl = groups.group_start_loc
        input_keep = None
        if self.w_gate_t is not None:  # the same channels on every rank: x is replicated
            hidden = self.w_gate_t.shape[0]
            input_keep = min(hidden, max(1, math.ceil(rt.ffn.gate_input_keep_ratio * hidden)))
            gate, _ = ops.input_sparse_gate(xv, self.w_gate_t, gsl, input_keep)
            partial, _ = ops.topk_swiglu_ffn_gated(xv, gate, self.w_up, self.w_down_t, gsl, keep)
        elif self.gate_linear is not None:
            gate = self.gate_linear(xv)
            partial, _ = ops.topk_swiglu_ffn_gated(xv, gate, self.w_up, self.w_down_t, gsl, keep)
        else:
            gate = None
            partial, _ = ops.topk_swiglu_ffn(xv, self.w_gate_up, self.w_down_t, gsl, keep)
        if rt.check_reference:
            self._check_reference(xv, gate, partial, groups, keep, input_keep, rt)
        sparse_out = self._reduce(partial)
        if all_verify:
            out = sparse_out
        else:  # mixed step: verify tokens sparse, the rest (and any padding) dense
            other = groups.dense_index(x.shape[0])
            out = torch.empty_like(x)
            out[groups.token_index] = sparse_out
            if other.numel():
                out[other] = self._dense(x[other])
        # Each group reads the up/down rows of its own `keep` neurons (counted from the sizes, not
        # from the selection: no extra work on the measured path).
        rt.record(ffn_layers_sparse=1, ffn_neurons_read=keep * groups.num_groups,
                  ffn_neurons_dense=self.intermediate)
        if input_keep is not None:  # the gate's rows read: hidden channels of the transposed gate
            rt.record(ffn_gate_channels_read=input_keep * groups.num_groups,
                      ffn_gate_channels_dense=self.w_gate_t.shape[0])
        return out

    def _check_reference(self, xv, gate, partial, groups, keep, input_keep, rt) -> None:
        """Test hook: this rank's output for the verify tokens (before the TP all-reduce) equals
        reference.topk_swiglu_ffn over this rank's weights (the gated one on the gate it used), and
        that gate x @ w_gate^T, or reference.input_sparse_gate's for "input_sparse"."""
        from vllm_sparsever import reference

        gsl = groups.group_start_loc
        expected = torch.empty_like(xv)
        selected = torch.empty(gsl.numel() - 1, keep, dtype=torch.int32)
        if gate is None:
            reference.topk_swiglu_ffn(expected, xv, self.w_gate_up, self.w_down_t, gsl, keep, selected)
        else:
            reference.topk_swiglu_ffn_gated(expected, xv, gate, self.w_up, self.w_down_t, gsl, keep, selected)
        err = float((partial.float() - expected.float()).abs().max())
        if input_keep is not None:
            expected_gate = torch.empty_like(gate)
            channels = torch.empty(gsl.numel() - 1, input_keep, dtype=torch.int32)
            reference.input_sparse_gate(expected_gate, xv, self.w_gate_t, gsl, input_keep, channels)
            err = max(err, float((gate.float() - expected_gate.float()).abs().max()))
        elif gate is not None and self._w_gate_check is not None:  # the given gate itself
            err = max(err, float((gate.float() - xv.float() @ self._w_gate_check.float().t()).abs().max()))
        rt.record_reference_error("ffn", err)

    def _reduce(self, out: torch.Tensor) -> torch.Tensor:
        if not self.reduce_results:
            return out
        from vllm.distributed import tensor_model_parallel_all_reduce

        return tensor_model_parallel_all_reduce(out)


def shared_dense_op_max_tokens(dtype: torch.dtype) -> int:
    """Up to how many tokens a dense step with "shared" weights runs the op at keep = I instead of
    torch's linear on the plain weights: where the op streams the weights (its GEMM path takes over
    at 64 tokens on the vdpbf16ps path, 16 on the widening one, 128 in fp32) and measured faster
    than torch's linear (bench/kernels/run.py, "Dense steps with `ffn.weights: shared`")."""
    if dtype == torch.float32:
        return 64
    if dtype == torch.bfloat16 and ops.bf16_dot_available():
        return 16
    return 4


def resolve_dense_kernel(choice: str, enabled: bool, weights: str, dtype: torch.dtype,
                         linear_kernel: str = "vllm") -> str:
    """`ffn.dense_kernel` in force for a target of `dtype` whose linears run `linear_kernel` (resolved;
    config.py has the rule)."""
    if choice == "sparsever" and not is_cpu_platform():
        raise RuntimeError("ffn.dense_kernel: 'sparsever' runs on CPU only (allowed here: 'auto', 'vllm')")
    if choice != "auto":
        return choice
    if not is_cpu_platform():
        return "vllm"
    if enabled:  # the op beats torch's linear on plain weights at few tokens; "copy" keeps vLLM's packed MLP
        return "sparsever" if weights == "shared" else "vllm"
    # The stock MLP on dense_linear (linear_kernel "sparsever") beats the op at keep = I, which also
    # scores and orders every neuron (bench/results/verify_step_qwen-zen3-linear-sparsever-mlp-stock_*).
    from vllm_sparsever.verification.lossless.linear_kernel import slow_16bit_cpu_linear

    return "sparsever" if slow_16bit_cpu_linear(dtype) and linear_kernel == "vllm" else "vllm"


def resolve_gate(gate: str, w_gate: torch.Tensor, weights: str = "copy") -> str:
    """ffn.gate for a layer whose gate rows (this rank's) are `w_gate`: "auto" resolved. With
    "shared" weights "auto" is "kernel": the stock linear would pack a second copy of the gate rows."""
    if gate != "auto":
        return gate
    if weights == "shared":
        return "kernel"
    big = w_gate.numel() * w_gate.element_size() >= FFN_STOCK_GATE_MIN_BYTES
    return "stock" if is_cpu_platform() and big else "kernel"


def plain_weight(linear: nn.Module) -> torch.Tensor:
    """The [out, in] weight of a linear layer (the plain copy kept in "copy" mode, else `weight`)."""
    return getattr(linear, "_sparsever_plain_weight", linear.weight)


def _is_swiglu_mlp(module: nn.Module) -> bool:
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    act = getattr(module, "act_fn", None)
    return (
        gate_up is not None
        and down is not None
        and type(act).__name__ == "SiluAndMul"
        and hasattr(gate_up, "weight")
        and hasattr(down, "weight")
    )


def install_ffn(model: nn.Module, architecture: str, gate: str = "auto", weights: str = "copy",
                dense_kernel: str = "vllm", field: str | None = "ffn.enabled") -> int:
    """Wrap every SwiGLU MLP of the target (`gate`: ffn.gate, `weights`: ffn.weights, `dense_kernel`:
    ffn.dense_kernel resolved); returns how many were wrapped. A model the wrapper cannot serve is an
    error naming `field`, the setting that asked for it; None: nobody asked (ffn.dense_kernel "auto"),
    so the model keeps its stock MLP."""
    found = [(name, m) for name, m in model.named_modules() if _is_swiglu_mlp(m)]
    problem = None if found else (
        f"no SwiGLU MLP (gate_up_proj + SiluAndMul + down_proj) found in {architecture}; sparsever's FFN "
        f"op supports dense Llama/Qwen2/Mistral-style MLPs")
    for name, mlp in found:
        for linear in (mlp.gate_up_proj, mlp.down_proj):
            w = plain_weight(linear)
            if getattr(linear, "bias", None) is not None:
                problem = problem or f"{name} has biased projections (unsupported)"
            elif w.ndim != 2 or w.numel() == 0 or not w.is_floating_point():
                problem = problem or (f"{name} has no plain floating-point weights (quantized or repacked); "
                                      f"sparsever's FFN op needs an unquantized model")
    if problem is not None:
        if field is None:
            logger.info("sparsever: the target keeps its stock MLP on dense steps: %s", problem)
            return 0
        allowed = "'auto', 'vllm'" if field == "ffn.dense_kernel" else "false"
        raise RuntimeError(f"{field}: {problem} (allowed for this model: {allowed})")
    count, gates = 0, set()
    for name, mlp in found:
        layer_idx = layer_index_of(name)
        if layer_idx is None:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        wrapped = SparseSwiGLUMLP(mlp, name, layer_idx, gate, weights, dense_kernel)
        setattr(parent, child, wrapped)
        gates.add(wrapped.gate)
        count += 1
    logger.info("sparsever: FFN gate projection on verify steps: %s (ffn.gate=%s)", "/".join(sorted(gates)), gate)
    rt = get_runtime()
    if rt is not None:
        rt.ffn_gates |= gates
        rt.ffn_dense_op_max_tokens = wrapped.dense_op_max_tokens if count else 0
    return count


@contextlib.contextmanager
def keep_mlp_weights(mode: str = "copy", linear=torch.nn.functional.linear) -> Iterator[None]:
    """While the target loads on CPU: keep the MLP linears' plain weights ("copy": besides vLLM's
    packed ones; "shared": instead of them, run by `linear(x, weight, bias)`, default torch's)."""
    if not is_cpu_platform():
        yield
        return

    def dispatch(layer, remove_weight, stock) -> None:
        if layer_prefix(layer).endswith(_MLP_LINEAR_SUFFIXES) and layer.weight.ndim == 2:
            if mode == "shared":
                use_plain_cpu_linear(layer, linear)
                return
            layer._sparsever_plain_weight = layer.weight.data  # survives the packing's removal
        stock(layer, remove_weight)

    with cpu_gemm_dispatch_override(dispatch):
        yield
