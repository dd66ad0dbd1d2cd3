"""ffn.gate: where the dense gate projection of a verify step runs (verification/ffn.py)."""

import pytest
import torch
from torch import nn

from vllm_sparsever.config import FFN_STOCK_GATE_MIN_BYTES
from vllm_sparsever.verification.ffn import SparseSwiGLUMLP, resolve_gate


def test_auto_takes_the_stock_linear_for_large_gates_only():
    rows = FFN_STOCK_GATE_MIN_BYTES // (2 * 64)
    assert resolve_gate("auto", torch.empty(rows, 64, dtype=torch.bfloat16)) == "stock"
    assert resolve_gate("auto", torch.empty(rows - 1, 64, dtype=torch.bfloat16)) == "kernel"
    assert resolve_gate("auto", torch.empty(rows // 2, 64, dtype=torch.float32)) == "stock"
    assert resolve_gate("kernel", torch.empty(rows, 64, dtype=torch.bfloat16)) == "kernel"
    assert resolve_gate("stock", torch.empty(4, 64)) == "stock"


class _Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, keep_plain: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(0) if keep_plain else weight, requires_grad=False)
        if keep_plain:  # what keep_mlp_weights("copy") leaves: vLLM packed `weight`, the plain copy here
            self._sparsever_plain_weight = weight


def _mlp(h: int, inter: int, keep_plain: bool) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    w_gate_up, w_down = torch.randn(2 * inter, h, generator=gen), torch.randn(h, inter, generator=gen)
    mlp = nn.Module()
    mlp.gate_up_proj, mlp.down_proj = _Linear(w_gate_up, keep_plain), _Linear(w_down, keep_plain)
    return mlp, w_gate_up, w_down


@pytest.mark.parametrize("weights", ["copy", "shared"])
def test_stock_gate_runs_on_the_stock_linear_and_copy_drops_the_plain_gate_rows(weights):
    h, inter = 32, 48
    mlp, w_gate_up, w_down = _mlp(h, inter, keep_plain=weights == "copy")
    layer = SparseSwiGLUMLP(mlp, "model.layers.0.mlp", 0, "stock")
    x = torch.randn(3, h)
    assert layer.gate == "stock"
    torch.testing.assert_close(layer.gate_linear(x), x @ w_gate_up[:inter].t(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(layer.w_up, w_gate_up[inter:])
    torch.testing.assert_close(layer.w_down_t, w_down.t())
    if weights == "copy":  # the packed gate replaces the plain gate rows: +1x MLP weights, not 4/3
        assert layer.w_gate_up is None and not hasattr(mlp.gate_up_proj, "_sparsever_plain_weight")
    else:  # dense steps use the plain weight itself
        assert layer.w_gate_up is mlp.gate_up_proj.weight


def test_kernel_gate_keeps_the_plain_rows_for_the_op():
    mlp, w_gate_up, _ = _mlp(32, 48, keep_plain=True)
    layer = SparseSwiGLUMLP(mlp, "model.layers.0.mlp", 0, "kernel")
    assert layer.gate_linear is None and torch.equal(layer.w_gate_up, w_gate_up)


@pytest.mark.parametrize("weights", ["copy", "shared"])
def test_input_sparse_gate_keeps_a_transposed_gate(weights):
    h, inter = 32, 48
    mlp, w_gate_up, w_down = _mlp(h, inter, keep_plain=weights == "copy")
    layer = SparseSwiGLUMLP(mlp, "model.layers.0.mlp", 0, "input_sparse")
    assert layer.gate == "input_sparse" and layer.gate_linear is None
    # [H, I], contiguous: a channel's gate weights are one row, read only if the channel is kept.
    assert layer.w_gate_t.is_contiguous() and torch.equal(layer.w_gate_t, w_gate_up[:inter].t())
    torch.testing.assert_close(layer.w_up, w_gate_up[inter:])
    if weights == "copy":  # the transposed gate replaces the plain gate rows
        assert layer.w_gate_up is None and not hasattr(mlp.gate_up_proj, "_sparsever_plain_weight")
    else:
        assert layer.w_gate_up is mlp.gate_up_proj.weight
