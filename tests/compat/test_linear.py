"""vLLM's CPU linear weight preparation as the FFN path intercepts it (compat.linear)."""

import inspect

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
