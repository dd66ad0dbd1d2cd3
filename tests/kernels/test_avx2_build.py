"""The AVX2 build (_C, for CPUs without AVX-512) must give the same results as the reference.

Both builds register the same `sparsever` library, so the AVX2 one runs in a fresh process.
"""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = r'''
import importlib, math, sys
importlib.import_module("vllm_sparsever._C")
import vllm_sparsever._C_loader as loader
loader._loaded = "vllm_sparsever._C"
import torch
torch.set_num_threads(2)
import vllm_sparsever._custom_ops as ops
import vllm_sparsever.reference as ref
sys.path.insert(0, "tests")
from op_inputs import SELECTION_TIE_RTOL, assert_ffn_matches_reference, start_loc
from tests.kernels.kv_cache_utils import make_paged_kv
assert torch.ops.sparsever.ext_info() == "avx2"
gen = torch.Generator().manual_seed(0)
for dtype, tol in [(torch.float32, 2e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)]:
    seq_lens, q_lens, hkv, group, d, bs = [300, 77], [4, 9], 2, 3, 40, 32
    kc, vc, bt, _ = make_paged_kv(seq_lens, hkv, d, bs, dtype, "cpu", gen)
    q = torch.randn(sum(q_lens), hkv * group, d, generator=gen).to(dtype)
    sl, qsl = torch.tensor(seq_lens, dtype=torch.int32), start_loc(q_lens)
    out = ops.block_sparse_tree_attention(q, kc, vc, bt, sl, qsl, 0.15)
    exp = torch.empty_like(out)
    ref.block_sparse_tree_attention(exp, q, kc, vc, bt, sl, qsl, None, None, None, 0.15)
    torch.testing.assert_close(out.float(), exp.float(), rtol=tol, atol=tol)
    x = torch.randn(5, 72, generator=gen).to(dtype)
    wgu = (torch.randn(200, 72, generator=gen) / 9).to(dtype)
    wdt = (torch.randn(100, 72, generator=gen) / 10).to(dtype)
    # Two groups, one of >= 16 tokens: both the streamed and the GEMM path, selection and output.
    gsl = start_loc([5, 20])
    xs = torch.randn(25, 72, generator=gen).to(dtype)
    out, sel = ops.topk_swiglu_ffn(xs, wgu, wdt, gsl, 30)
    assert_ffn_matches_reference(out, sel, xs, wgu, wdt, gsl, 30, SELECTION_TIE_RTOL[dtype])
    w13 = (torch.randn(4, 60, 72, generator=gen) / 9).to(dtype)
    w2 = (torch.randn(4, 72, 30, generator=gen) / 6).to(dtype)
    tw, ti = ops.moe_route_and_prune(torch.randn(5, 4, generator=gen), 2, 0.2)
    out, n = ops.moe_grouped_dispatch(x, tw, ti, w13, w2)
    exp, rn = torch.empty_like(out), torch.empty(1, dtype=torch.int32)
    ref.moe_grouped_dispatch(exp, x, tw, ti, w13, w2, rn)
    torch.testing.assert_close(out.float(), exp.float(), rtol=tol, atol=tol)
    assert int(n) == int(rn)
    wq = torch.randint(-127, 128, (9, 72), generator=gen, dtype=torch.int8)  # the portable int8 loop
    ws, bq = torch.rand(9, generator=gen), torch.randn(9, generator=gen).to(dtype)
    assert not ops.int8_vnni_available()
    out = ops.int8_linear(x, wq, ws, ops.int8_weight_sums(wq), bq)
    exp = torch.empty_like(out)
    ref.int8_linear(exp, x, wq, ws, ops.int8_weight_sums(wq), bq)
    torch.testing.assert_close(out.float(), exp.float(), rtol=tol, atol=tol)
print("AVX2 OK")
'''


def test_avx2_build_matches_reference():
    root = Path(__file__).resolve().parents[2]
    if not list((root / "vllm_sparsever").glob("_C.*.so")):
        pytest.fail("the AVX2 module vllm_sparsever/_C is not built")
    res = subprocess.run([sys.executable, "-c", SCRIPT], cwd=root, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "AVX2 OK" in res.stdout
