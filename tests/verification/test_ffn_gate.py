"""ffn.gate: where the dense gate projection of a verify step runs (verification/sparse/ffn.py)."""

import pytest
import torch
from torch import nn

from vllm_sparsever.config import FFN_STOCK_GATE_MIN_BYTES
from vllm_sparsever.verification.sparse.ffn import SparseSwiGLUMLP, resolve_gate


def test_auto_takes_the_stock_linear_for_large_gates_only():
    rows = FFN_STOCK_GATE_MIN_BYTES // (2 * 64)
    assert resolve_gate("auto", torch.empty(rows, 64, dtype=torch.bfloat16)) == "stock"
    assert resolve_gate("auto", torch.empty(rows - 1, 64, dtype=torch.bfloat16)) == "kernel"
    assert resolve_gate("auto", torch.empty(rows // 2, 64, dtype=torch.float32)) == "stock"
    assert resolve_gate("kernel", torch.empty(rows, 64, dtype=torch.bfloat16)) == "kernel"
    assert resolve_gate("stock", torch.empty(4, 64)) == "stock"


def test_auto_with_shared_weights_keeps_one_copy():
    # "stock" would pack a second copy of the gate rows: "shared" asked for none.
    rows = FFN_STOCK_GATE_MIN_BYTES // (2 * 64)
    assert resolve_gate("auto", torch.empty(rows, 64, dtype=torch.bfloat16), "shared") == "kernel"
    assert resolve_gate("stock", torch.empty(rows, 64, dtype=torch.bfloat16), "shared") == "stock"


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


class _PlainMLP(nn.Module):
    """An MLP loaded with "shared" weights: torch's linear on the plain weights (counts its calls)."""

    def __init__(self, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj = _Linear(w_gate_up, False), _Linear(w_down, False)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        g, u = torch.nn.functional.linear(x, self.gate_up_proj.weight).chunk(2, dim=-1)
        return torch.nn.functional.linear(torch.nn.functional.silu(g) * u, self.down_proj.weight)


@pytest.mark.parametrize("gate", ["auto", "kernel", "stock", "input_sparse"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_weights_dense_steps_run_the_op_for_few_tokens(gate, dtype):
    # With "shared" weights there is no packed copy: a dense step of up to dense_op_max_tokens tokens
    # runs the op at keep = I over the plain weights (every neuron: the MLP itself), beyond that torch's
    # linear.
    from vllm_sparsever.verification.sparse.ffn import shared_dense_op_max_tokens

    h, inter = 64, 96
    gen = torch.Generator().manual_seed(1)
    w_gate_up = (torch.randn(2 * inter, h, generator=gen) * h**-0.5).to(dtype)
    w_down = (torch.randn(h, inter, generator=gen) * inter**-0.5).to(dtype)
    mlp = _PlainMLP(w_gate_up, w_down)
    layer = SparseSwiGLUMLP(mlp, f"model.layers.0.mlp.shared.{gate}.{dtype}", 0, gate, weights="shared",
                            dense_kernel="sparsever")
    limit = layer.dense_op_max_tokens
    assert limit == shared_dense_op_max_tokens(dtype) >= 4
    for n in (1, limit, limit + 1):
        x = torch.randn(n, h, generator=gen).to(dtype)
        calls = mlp.calls
        out = layer._dense(x)
        assert mlp.calls == calls + (n > limit)  # the op below the limit, torch's linear above it
        g, u = (x.float() @ w_gate_up.float().t()).chunk(2, dim=-1)
        expected = (torch.nn.functional.silu(g) * u) @ w_down.float().t()
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)


def test_copy_weights_dense_steps_stay_stock():
    mlp, _, _ = _mlp(32, 48, keep_plain=True)
    assert SparseSwiGLUMLP(mlp, "model.layers.0.mlp.copy", 0, "kernel", weights="copy").dense_op_max_tokens == 0


def test_dense_kernel_vllm_keeps_dense_steps_on_the_stock_mlp():
    # ffn.dense_kernel "vllm" with "shared" weights: dense steps run the MLP's own (plain) linears.
    mlp = _PlainMLP(torch.randn(96, 32), torch.randn(32, 48))
    layer = SparseSwiGLUMLP(mlp, "model.layers.0.mlp.shared.vllm", 0, "kernel", weights="shared", dense_kernel="vllm")
    assert layer.dense_op_max_tokens == 0
    calls = mlp.calls
    layer._dense(torch.randn(2, 32))
    assert mlp.calls == calls + 1


@pytest.mark.parametrize("capability", ["AVX2", "AVX512"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dense_kernel_auto(monkeypatch, capability, dtype):
    """"auto": sparsever's op on dense steps where vLLM-CPU's 16-bit linear is torch's (no AVX-512),
    and wherever FFN sparsity keeps only plain ("shared") weights; vLLM's MLP otherwise."""
    from vllm_sparsever.verification.sparse import ffn

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(ffn, "is_cpu_platform", lambda: True)
    slow_16bit = capability == "AVX2" and dtype != torch.float32
    assert ffn.resolve_dense_kernel("auto", False, "copy", dtype) == ("sparsever" if slow_16bit else "vllm")
    # the stock MLP's linears on dense_linear (linear_kernel "sparsever") beat the op at keep = I
    assert ffn.resolve_dense_kernel("auto", False, "copy", dtype, "sparsever") == "vllm"
    assert ffn.resolve_dense_kernel("auto", True, "shared", dtype) == "sparsever"
    assert ffn.resolve_dense_kernel("auto", True, "copy", dtype) == "vllm"
    assert ffn.resolve_dense_kernel("vllm", False, "copy", dtype) == "vllm"
    assert ffn.resolve_dense_kernel("sparsever", False, "copy", dtype) == "sparsever"
    monkeypatch.setattr(ffn, "is_cpu_platform", lambda: False)
    assert ffn.resolve_dense_kernel("auto", False, "copy", dtype) == "vllm"
    with pytest.raises(RuntimeError, match=r"ffn\.dense_kernel: 'sparsever' runs on CPU only"):
        ffn.resolve_dense_kernel("sparsever", False, "copy", dtype)


def test_install_for_the_dense_kernel_alone_skips_a_model_it_cannot_serve():
    """ffn.dense_kernel "auto" (nobody asked by name) leaves a model without SwiGLU MLPs stock; asked
    for by name, the error names the setting and what is allowed."""
    from vllm_sparsever.verification.sparse.ffn import install_ffn

    model = nn.Sequential(nn.Linear(4, 4))
    assert install_ffn(model, "TinyArch", weights="shared", dense_kernel="sparsever", field=None) == 0
    with pytest.raises(RuntimeError, match=r"ffn\.dense_kernel: no SwiGLU MLP .*allowed for this model: 'auto', 'vllm'"):
        install_ffn(model, "TinyArch", weights="shared", dense_kernel="sparsever", field="ffn.dense_kernel")
    with pytest.raises(RuntimeError, match=r"ffn\.enabled: no SwiGLU MLP .*allowed for this model: false"):
        install_ffn(model, "TinyArch")


@pytest.mark.parametrize("capability", ["AVX2", "AVX512", "AVX512-BF16", "AMX"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_linear_kernel_auto(monkeypatch, capability, dtype):
    """linear_kernel "auto": sparsever's dense_linear where vLLM-CPU's 16-bit linear is torch's (a CPU
    without AVX-512, a bf16/fp16 target); vLLM's with few-token calls padded to 4 rows for such a
    target on AVX512-BF16 without AMX where oneDNN's 1-row path is measured slower (padding_pays: AMD
    Zen 4, not Zen 5); vLLM's otherwise, and always on GPUs."""
    from vllm_sparsever.verification.lossless import linear_kernel

    pays = {"yes": True}
    monkeypatch.setattr(linear_kernel, "padding_pays", lambda dtype: pays["yes"])
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2" if capability == "AVX2" else "AVX512")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: capability in ("AVX512-BF16", "AMX"))
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: capability == "AMX")
    monkeypatch.setattr(linear_kernel, "is_cpu_platform", lambda: True)
    sixteen_bit = dtype != torch.float32
    expected = ("sparsever" if capability == "AVX2" and sixteen_bit
                else "vllm-padded" if capability == "AVX512-BF16" and sixteen_bit else "vllm")
    assert linear_kernel.resolve_linear_kernel("auto", dtype) == expected
    pays["yes"] = False  # measured: a 1-row call is not the slower one here
    assert linear_kernel.resolve_linear_kernel("auto", dtype) == ("vllm" if expected == "vllm-padded" else expected)
    for choice in ("vllm", "sparsever", "hybrid", "vllm-padded"):
        assert linear_kernel.resolve_linear_kernel(choice, dtype) == choice
    monkeypatch.setattr(linear_kernel, "is_cpu_platform", lambda: False)
    assert linear_kernel.resolve_linear_kernel("auto", dtype) == "vllm"
    for choice in ("sparsever", "hybrid", "vllm-padded"):
        with pytest.raises(RuntimeError, match=rf"linear_kernel: '{choice}' runs on CPU only"):
            linear_kernel.resolve_linear_kernel(choice, dtype)


def test_padding_is_chosen_by_measurement_with_a_margin():
    from vllm_sparsever.verification.lossless.linear_kernel import PADDING_MIN_GAIN, padding_decision, padding_pays

    assert padding_decision(one_row_s=1.0, padded_s=0.5)  # Zen 4's oneDNN: 1-3 rows read slowly
    assert not padding_decision(one_row_s=0.60, padded_s=0.74)  # Zen 5's (measured)
    assert not padding_decision(one_row_s=1.0, padded_s=PADDING_MIN_GAIN * 1.01)  # within the noise: no
    if torch.backends.cpu.get_cpu_capability() == "AVX512" and torch.cpu._is_avx512_bf16_supported():
        # the real measurement: a decision, once per process
        first = padding_pays(torch.bfloat16)
        assert isinstance(first, bool) and padding_pays(torch.bfloat16) is first
        assert padding_pays.cache_info().hits >= 1


def test_hybrid_linears_keep_both_weights_and_switch_on_the_token_count():
    """linear_kernel "hybrid": vLLM-CPU prepares its packed weight (remove_weight=False: the plain one
    stays), calls of up to HYBRID_MAX_TOKENS tokens run dense_linear on the plain weight, longer ones
    vLLM-CPU's forward."""
    import vllm.model_executor.layers.utils as layer_utils

    from vllm_sparsever import _custom_ops as ops
    from vllm_sparsever.compat.linear import cpu_gemm_dispatch_override
    from vllm_sparsever.verification.lossless import linear_kernel

    packed_calls, removes = [], []

    def packed(x, weight, bias):
        packed_calls.append(x.shape[0])
        return torch.nn.functional.linear(x, weight, bias)

    def stock(layer, remove_weight, _vllms):  # stands in for vLLM-CPU's dispatch
        removes.append(remove_weight)
        layer.cpu_linear = packed

    with cpu_gemm_dispatch_override(stock):
        with linear_kernel.plain_linears(hybrid=True):
            lin = torch.nn.Module()
            w = torch.randn(6, 8, dtype=torch.bfloat16)
            lin.weight = torch.nn.Parameter(w, requires_grad=False)
            layer_utils.dispatch_cpu_unquantized_gemm(lin, remove_weight=True)
    assert removes == [False] and lin.weight.shape == (6, 8) and lin.cpu_linear is not packed
    few = linear_kernel.hybrid_max_tokens(torch.bfloat16)
    assert few == (8 if ops.amx_available() else 4)
    for tokens in (1, few, few + 1, 40):
        x = torch.randn(tokens, 8, dtype=torch.bfloat16)
        torch.testing.assert_close(lin.cpu_linear(x, lin.weight, None).float(), x.float() @ w.float().t(),
                                   rtol=2e-2, atol=2e-2)
    assert packed_calls == [few + 1, 40]


@pytest.mark.parametrize("shape", [(1, 8), (2, 8), (3, 8), (1, 1, 8), (4, 8), (9, 8), (2, 3, 8)])
def test_padded_linear_runs_few_tokens_as_four_rows(shape):
    """linear_kernel "vllm-padded": a call of 1-3 tokens reaches vLLM-CPU's forward as a 4-row call
    whose extra rows are zeros, and returns its first rows in the input's leading shape; 4 and more
    tokens go through as they are."""
    from vllm_sparsever.verification.lossless import linear_kernel

    w, b = torch.randn(6, 8, dtype=torch.bfloat16), torch.randn(6, dtype=torch.bfloat16)
    calls = []

    def stock(x, weight, bias):
        calls.append(x.clone())
        return torch.nn.functional.linear(x, w, bias)

    forward = linear_kernel.padded_cpu_linear(stock)
    x = torch.randn(*shape, dtype=torch.bfloat16)
    out = forward(x, None, b)
    tokens = x.numel() // 8
    assert out.shape == (*shape[:-1], 6)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w, b))
    (seen,) = calls
    if tokens < linear_kernel.PADDED_ROWS:
        assert seen.shape == (linear_kernel.PADDED_ROWS, 8)
        assert torch.equal(seen[:tokens], x.reshape(tokens, 8)) and not seen[tokens:].any()
    else:
        assert seen.shape == x.shape


def test_padded_linears_wrap_the_stock_forward_of_2d_weights():
    """While a model loads with linear_kernel "vllm-padded": every weight goes to vLLM-CPU's dispatch
    as it would (its packing and removal), and a 2-D layer's forward is then the stock one behind the
    padding (16-bit or fp32: "auto" picks the kernel for 16-bit models only); 3-D weights keep the
    stock forward."""
    import vllm.model_executor.layers.utils as layer_utils

    from vllm_sparsever.compat.linear import cpu_gemm_dispatch_override
    from vllm_sparsever.verification.lossless import linear_kernel

    removes, rows = [], []

    def stock(layer, remove_weight, _vllms):
        removes.append(remove_weight)
        w = layer.weight.detach().clone()

        def forward(x, weight, bias):
            rows.append(x.shape[0])
            return torch.nn.functional.linear(x, w, bias)

        layer.cpu_linear = forward

    layers = {}
    with cpu_gemm_dispatch_override(stock):
        with linear_kernel.padded_linears():
            for name, shape, dtype in (("bf16", (6, 8), torch.bfloat16), ("fp32", (6, 8), torch.float32),
                                       ("experts", (2, 6, 8), torch.bfloat16)):
                layer = torch.nn.Module()
                layer.weight = torch.nn.Parameter(torch.randn(*shape, dtype=dtype), requires_grad=False)
                layer_utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
                layers[name] = layer
    assert removes == [True, True, True]
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        rows.clear()
        x = torch.randn(1, 8, dtype=dtype)
        assert layers[name].cpu_linear(x, None, None).shape == (1, 6)
        assert rows == [linear_kernel.PADDED_ROWS]
    assert layers["experts"].cpu_linear.__qualname__.endswith("stock.<locals>.forward")


def test_padded_linears_on_vllms_own_dispatch():
    """linear_kernel "vllm-padded" over vLLM-CPU's real dispatch (oneDNN where it applies): one token's
    product is the first row of the 4-row call it becomes, bit for bit, and the reference product
    within bf16 rounding."""
    import vllm.model_executor.layers.utils as layer_utils

    from vllm_sparsever.verification.lossless import linear_kernel

    w = torch.randn(96, 64, dtype=torch.bfloat16)
    stock = torch.nn.Module()
    stock.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
    layer_utils.dispatch_cpu_unquantized_gemm(stock, remove_weight=False)
    with linear_kernel.padded_linears():
        padded = torch.nn.Module()
        padded.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
        layer_utils.dispatch_cpu_unquantized_gemm(padded, remove_weight=True)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    for tokens in (1, 3):
        out = padded.cpu_linear(x[:tokens], padded.weight, None)
        rows = torch.cat([x[:tokens], x.new_zeros(4 - tokens, 64)])
        assert torch.equal(out, stock.cpu_linear(rows, stock.weight, None)[:tokens])
        torch.testing.assert_close(out.float(), x[:tokens].float() @ w.float().t(), rtol=2e-2, atol=5e-2)


def test_plain_linears_keep_the_weight_and_run_dense_linear():
    """While the target loads with linear_kernel "sparsever": a 2-D linear keeps its plain weight (vLLM's
    packing never runs) and its CPU forward is dense_linear; other weights go to the stock dispatch."""
    from vllm_sparsever.compat.linear import cpu_gemm_dispatch_override
    from vllm_sparsever.verification.lossless import linear_kernel

    stock_calls = []
    with cpu_gemm_dispatch_override(lambda layer, remove_weight, stock: stock_calls.append(layer)):
        with linear_kernel.plain_linears():
            import vllm.model_executor.layers.utils as layer_utils

            lin = torch.nn.Module()
            lin.weight = torch.nn.Parameter(torch.randn(6, 8, dtype=torch.bfloat16), requires_grad=False)
            layer_utils.dispatch_cpu_unquantized_gemm(lin, remove_weight=True)
            experts = torch.nn.Module()
            experts.weight = torch.nn.Parameter(torch.randn(2, 6, 8), requires_grad=False)
            layer_utils.dispatch_cpu_unquantized_gemm(experts, remove_weight=True)
    assert stock_calls == [experts]
    assert lin.weight.shape == (6, 8) and lin.cpu_linear is linear_kernel.sparsever_cpu_linear
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    torch.testing.assert_close(lin.cpu_linear(x, lin.weight, None).float(), x.float() @ lin.weight.float().t(),
                               rtol=2e-2, atol=2e-2)
