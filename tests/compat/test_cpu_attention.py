"""vLLM's CPU attention backend as the sparse attention backend uses it (compat.cpu_attention)."""

import dataclasses

import pytest
import torch

from vllm_sparsever import reference
from vllm_sparsever.compat import check_signature
from vllm_sparsever.compat import cpu_attention as vllm_attn
from vllm_sparsever.verification.lossless.kv_layout import paged_kv_views


@pytest.mark.parametrize("cls,hooks", [
    (vllm_attn.CPUAttentionMetadataBuilder, vllm_attn.BUILDER_HOOKS),
    (vllm_attn.CPUAttentionBackendImpl, vllm_attn.IMPL_HOOKS),
    (vllm_attn.CPUAttentionBackend, vllm_attn.BACKEND_HOOKS),
])
def test_overridden_methods_have_the_assumed_signatures(cls, hooks):
    for name, params in hooks.items():
        assert check_signature(cls, name, params) is None


def test_builder_isa_is_an_attribute_handed_to_layers():
    """The builder stores its ISA in `isa` and `_set_isa_to_layers` copies it to `layer.isa`."""
    builder = vllm_attn.CPUAttentionMetadataBuilder
    assert "isa" in builder.__init__.__code__.co_names
    assert "_set_isa_to_layers" in builder.__init__.__code__.co_names
    assert "isa" in builder._set_isa_to_layers.__code__.co_names
    # And the impl writes the KV cache in `layer.isa`'s layout with the layer's float scales.
    names = vllm_attn.CPUAttentionBackendImpl.do_kv_cache_update.__code__.co_names
    assert {"isa", "_k_scale_float", "_v_scale_float"} <= set(names)


def test_builder_sets_the_geometry_the_planner_reads():
    """The builder's __init__ assigns every attribute of BUILDER_GEOMETRY (read by the planner)."""
    import dis

    stored = {i.argval for i in dis.get_instructions(vllm_attn.CPUAttentionMetadataBuilder.__init__)
              if i.opname == "STORE_ATTR"}
    assert set(vllm_attn.BUILDER_GEOMETRY) <= stored


def test_layer_names_of_builders_and_attention_layers():
    """Builders keep the names of the layers they serve; attention layers keep the name the forward
    context knows them by (what decides which builder plans the target's steps)."""
    import dis

    from vllm.v1.attention.backend import AttentionMetadataBuilder

    def stored(fn):
        return {i.argval for i in dis.get_instructions(fn) if i.opname == "STORE_ATTR"}

    assert "layer_names" in stored(AttentionMetadataBuilder.__init__)
    assert "layer_name" in stored(vllm_attn.Attention.__init__)
    from types import SimpleNamespace

    assert vllm_attn.builder_layer_names(SimpleNamespace(layer_names=("a", "b"))) == ["a", "b"]


def test_builder_isa_accessors():
    from types import SimpleNamespace

    builder = SimpleNamespace(isa="amx")
    assert vllm_attn.builder_isa(builder) == "amx"
    vllm_attn.set_builder_isa(builder, "vec")
    assert builder.isa == "vec"


def test_layer_float_scales_are_set_by_vllm():
    from vllm.model_executor.layers.attention.attention import set_default_quant_scales

    layer = torch.nn.Module()
    set_default_quant_scales(layer, register_buffer=True)
    assert vllm_attn.layer_kv_scales(layer) == (1.0, 1.0)


def test_metadata_fields():
    fields = {f.name for f in dataclasses.fields(vllm_attn.CPUAttentionMetadata)}
    assert set(vllm_attn.METADATA_FIELDS) <= fields


def _impl(**kwargs):
    from types import SimpleNamespace
    from unittest import mock

    import vllm.v1.attention.backends.cpu_attn as cpu_attn

    args = dict(num_heads=4, head_size=64, scale=0.125, num_kv_heads=2, alibi_slopes=None,
                sliding_window=None, kv_cache_dtype="auto")
    args.update(kwargs)
    # The impl reads only the model dtype from the current config (to pick zentorch SDPA).
    config = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32))
    with mock.patch.object(cpu_attn, "get_current_vllm_config", return_value=config):
        return vllm_attn.CPUAttentionBackendImpl(**args)


def test_impl_attributes_and_supported_features():
    impl = _impl()
    for name in vllm_attn.IMPL_ATTRIBUTES:
        assert hasattr(impl, name), name
    assert (impl.num_heads, impl.num_kv_heads, impl.head_size, impl.scale) == (4, 2, 64, 0.125)
    assert impl.sliding_window == -1 and impl.logits_soft_cap == 0  # vLLM's "none" values
    assert vllm_attn.impl_supports_sparse(impl)
    assert not vllm_attn.impl_supports_sparse(_impl(sliding_window=64))
    assert not vllm_attn.impl_supports_sparse(_impl(logits_soft_cap=30.0))
    assert not vllm_attn.impl_supports_sparse(_impl(alibi_slopes=[0.5] * 4))
    assert not vllm_attn.impl_supports_sparse(_impl(kv_cache_dtype="fp8"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vec_layout_written_by_vllm_reads_back_through_paged_kv_views(dtype):
    """KV tensor [nb, Hkv, bs, 2D]: vLLM's `vec` write puts K transposed then V per block and head."""
    nb, hkv, bs, d = 3, 2, 32, 64
    kv_cache = torch.zeros(nb, hkv, bs, 2 * d, dtype=dtype)
    n = 50
    key, value = torch.randn(n, hkv, d).to(dtype), torch.randn(n, hkv, d).to(dtype)
    slots = torch.randperm(nb * bs)[:n].to(torch.int64)
    vllm_attn.write_kv_cache(key, value, kv_cache, slots, "vec")
    key_view, value_view = paged_kv_views(kv_cache)
    blocks, offsets = slots // bs, slots % bs
    assert torch.equal(key_view[blocks, :, offsets], key)
    assert torch.equal(value_view[blocks, :, offsets], value)
    # K is stored transposed: the first D*bs elements of a block/head are K[:, 0] for the bs slots.
    block0 = kv_cache[blocks[0], 0].flatten()
    assert block0[offsets[0] + bs * torch.arange(d)].tolist() == key[0, 0].tolist()


def test_impl_do_kv_cache_update_writes_the_layout_paged_kv_views_reads():
    from vllm.model_executor.layers.attention.attention import set_default_quant_scales

    nb, hkv, bs, d = 2, 2, 32, 64
    impl = _impl(num_heads=4, num_kv_heads=hkv, head_size=d)
    layer = torch.nn.Module()
    set_default_quant_scales(layer, register_buffer=True)
    layer.isa = "vec"
    kv_cache = torch.zeros(nb, hkv, bs, 2 * d)
    key, value = torch.randn(5, hkv, d), torch.randn(5, hkv, d)
    slots = torch.tensor([33, 34, 35, 0, 63])
    impl.do_kv_cache_update(layer, key, value, kv_cache, slots)
    key_view, value_view = paged_kv_views(kv_cache)
    assert torch.equal(key_view[slots // bs, :, slots % bs], key)
    assert torch.equal(value_view[slots // bs, :, slots % bs], value)


def test_split_kv_setting():
    from vllm import envs

    assert isinstance(vllm_attn.split_kv_enabled(), bool)
    assert vllm_attn.split_kv_enabled() == bool(envs.VLLM_CPU_ATTN_SPLIT_KV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vllm_attention_over_block_table_matches_reference(dtype):
    """vLLM's scheduler metadata + CPU attention over a block table (through the compat wrappers, with
    the keywords the sparse backend passes) = the reference with every context block selected."""
    bs, d, hkv, group = 32, 64, 2, 2
    seq_lens, query_lens = [100, 37], [4, 1]
    g = torch.Generator().manual_seed(3)
    block_table = torch.tensor([[5, 2, 7, 0], [1, 6, -1, -1]], dtype=torch.int32)
    nb = 8
    kv_cache = torch.zeros(nb, hkv, bs, 2 * d, dtype=dtype)
    for r, s in enumerate(seq_lens):
        pos = torch.arange(s)
        slots = block_table[r, pos // bs].to(torch.long) * bs + pos % bs
        vllm_attn.write_kv_cache(torch.randn(s, hkv, d, generator=g).to(dtype),
                                 torch.randn(s, hkv, d, generator=g).to(dtype), kv_cache, slots, "vec")
    qsl = torch.tensor([0, 4, 5], dtype=torch.int32)
    seq_t = torch.tensor(seq_lens, dtype=torch.int32)
    query = torch.randn(5, hkv * group, d, generator=g).to(dtype)
    sched = vllm_attn.scheduler_metadata(
        num_reqs=2, num_heads=hkv * group, num_kv_heads=hkv, head_dim=d, seq_lens=seq_t, dtype=dtype,
        query_start_loc=qsl, causal=True, sliding_window_size=-1, isa="vec", kv_cache_dtype="auto")
    key_cache, value_cache = vllm_attn.stock_kv_halves(kv_cache)
    out = torch.zeros_like(query)
    vllm_attn.attention_over_block_table(
        query=query, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=qsl,
        seq_lens=seq_t, scale=d ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1,
        block_table=block_table.clamp(min=0), softcap=0, scheduler_metadata=sched, s_aux=None,
        k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")

    ctx_blocks = [(s - q + bs - 1) // bs for s, q in zip(seq_lens, query_lens)]
    selected = torch.full((2, hkv, 4), -1, dtype=torch.int32)
    for r, n in enumerate(ctx_blocks):
        selected[r, :, :n] = torch.arange(n, dtype=torch.int32)
    num_selected = torch.tensor(ctx_blocks, dtype=torch.int32).view(2, 1).expand(2, hkv).contiguous()
    expected = torch.zeros_like(query)
    key_plain, value_plain = paged_kv_views(kv_cache)
    reference.block_sparse_tree_attention(expected, query, key_plain, value_plain, block_table, seq_t, qsl,
                                          selected, num_selected, None, d ** -0.5)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)


def test_register_cpu_attention_backend_overrides_cpu_attn():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_sparsever.verification.sparse.attention import SparseverCPUAttentionBackend

    entry = AttentionBackendEnum.CPU_ATTN
    was_overridden = entry.is_overridden()
    previous = entry.get_path() if was_overridden else None
    try:
        vllm_attn.register_cpu_attention_backend(SparseverCPUAttentionBackend)
        assert entry.get_class() is SparseverCPUAttentionBackend
    finally:
        if was_overridden:
            from vllm.v1.attention.backends.registry import register_backend

            register_backend(entry, previous)
        else:
            entry.clear_override()
    assert entry.is_overridden() == was_overridden


def test_registration_clears_the_selectors_memo(monkeypatch):
    # vLLM memoises the backend class per selector config (functools.cache); an engine started
    # earlier in the same process would otherwise hand the next one the stock class.
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_sparsever.verification.sparse.attention import SparseverCPUAttentionBackend

    assert callable(selector._cached_get_attn_backend.cache_clear)
    cleared = []
    monkeypatch.setattr(selector, "_cached_get_attn_backend",
                        type("Memo", (), {"cache_clear": staticmethod(lambda: cleared.append(True))}))
    entry = AttentionBackendEnum.CPU_ATTN
    was_overridden = entry.is_overridden()
    previous = entry.get_path() if was_overridden else None
    try:
        vllm_attn.register_cpu_attention_backend(SparseverCPUAttentionBackend)
        assert cleared == [True]
    finally:
        if was_overridden:
            from vllm.v1.attention.backends.registry import register_backend

            register_backend(entry, previous)
        else:
            entry.clear_override()
