"""The KV cache layout the CUDA attention kernels are timed and tested on is vLLM's GPU FlashAttention layout.

vLLM 0.32's FlashAttention backend views each layer's cache `[num_blocks, num_kv_heads, block_size, 2 * D]`
as `kv_cache.transpose(1, 2).split(head_size, dim=-1)`: every token's row holds K then V, head_dim
contiguous. The CUDA kernels take strided K/V views and need only that (tests/simt/kv_inputs.py "gpu",
bench/gpu/check.py); a vLLM that changes the split fails here first. GPU-only code: checked by source only.
"""

import inspect


def test_flash_attention_splits_each_token_row_into_k_then_v():
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

    for method in (FlashAttentionImpl.forward, FlashAttentionImpl.do_kv_cache_update):
        assert "kv_cache.transpose(1, 2).split(self.head_size, dim=-1)" in inspect.getsource(method)
