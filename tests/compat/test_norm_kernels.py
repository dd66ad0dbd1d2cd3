"""compat.model.use_c_kernels_where_faster: a draft model's RMSNorm on vLLM-CPU's C kernels and its
SiluAndMul on its C kernel for one-token calls (vLLM's own for more), computing what vLLM's own
modules compute (to rounding)."""

import pytest
import torch


@pytest.fixture(scope="module")
def modules():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm

    with set_current_vllm_config(VllmConfig()):
        yield RMSNorm, SiluAndMul


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_c_kernels_match_vllms_modules(modules, dtype, tol):
    from vllm_sparsever.compat.model import use_c_kernels_where_faster

    rms_norm, silu_and_mul = modules
    gen = torch.Generator().manual_seed(0)

    def model():
        m = torch.nn.Module()
        m.norm = rms_norm(96, eps=1e-5).to(dtype)
        m.norm.weight.data = (torch.rand(96, generator=gen) + 0.5).to(dtype)
        m.act = silu_and_mul()
        m.other = rms_norm(96, eps=1e-5, var_hidden_size=48).to(dtype)  # a partial-variance norm: left to vLLM
        return m

    stock, fast = model(), model()
    fast.norm.weight.data = stock.norm.weight.data.clone()
    assert use_c_kernels_where_faster(fast) == 2
    assert "_c_" not in getattr(fast.other._forward_method, "__qualname__", "")  # left to vLLM
    x = torch.randn(3, 96, generator=gen).to(dtype)
    r = torch.randn(3, 96, generator=gen).to(dtype)
    with torch.inference_mode():
        torch.testing.assert_close(fast.norm(x.clone()), stock.norm(x.clone()), rtol=tol, atol=tol)
        got, got_res = fast.norm(x.clone(), r.clone())
        want, want_res = stock.norm(x.clone(), r.clone())
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        torch.testing.assert_close(got_res, want_res, rtol=tol, atol=tol)
        for tokens in (1, 3):  # one token: the C kernel; more: vLLM's own
            g = torch.randn(tokens, 2 * 64, generator=gen).to(dtype)
            torch.testing.assert_close(fast.act(g), stock.act(g), rtol=tol, atol=tol)
        assert "_c_" in fast.norm._forward_method.__qualname__ and "_c_" in fast.act._forward_method.__qualname__


def test_silu_and_mul_runs_the_c_kernel_for_one_token_only(modules):
    """Which kernel a draft's SwiGLU call takes: vLLM-CPU's C kernel at one token (faster there), vLLM's
    own torch ops for more (the C kernel's scalar exponentials are slower there)."""
    from vllm_sparsever.compat.model import use_c_kernels_where_faster

    _, silu_and_mul = modules
    m = torch.nn.Module()
    m.act = silu_and_mul()
    stock = m.act._forward_method
    stock_calls = []
    m.act._forward_method = lambda x: stock_calls.append(x.shape[0]) or stock(x)
    assert use_c_kernels_where_faster(m) == 1
    gen = torch.Generator().manual_seed(1)
    for tokens in (1, 2, 8):
        g = torch.randn(tokens, 2 * 64, generator=gen)
        got = m.act(g)
        if tokens == 1:
            want = torch.empty(1, 64)
            torch.ops._C.silu_and_mul(want, g)
            assert torch.equal(got, want)
    assert stock_calls == [2, 8]


def test_custom_op_forward_calls_the_instance_method(modules):
    """CustomOp.forward dispatches through the instance's `_forward_method` (what the swap sets)."""
    rms_norm, _ = modules
    norm = rms_norm(8)
    norm._forward_method = lambda x, residual=None: "mine"
    assert norm(torch.zeros(1, 8)) == "mine"
    for attr in ("variance_epsilon", "variance_size_override", "has_weight", "weight"):
        assert hasattr(rms_norm(8), attr)
    for op in ("rms_norm", "fused_add_rms_norm", "silu_and_mul"):
        assert hasattr(torch.ops._C, op), op
