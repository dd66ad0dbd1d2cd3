"""GPU safety of the sparse verify path, checked on CPU: sparse FFN/MoE refused under CUDA graphs (with an
error naming enforce_eager), and MoE expert counts kept on the device (no host sync per layer)."""

import pytest
import torch

from vllm_sparsever.config import SparseverConfig, SparseverConfigError
from vllm_sparsever.compat.engine_args import engine_args_cls, uses_cuda_graphs
from vllm_sparsever.verification.sparse.moe import distinct_experts
from vllm_sparsever.verification.sparse.runtime import SparseVerificationRuntime
from vllm_sparsever.verification.support import check_cpu_only_kernels, check_cuda_graphs


def _config(**sections) -> SparseverConfig:
    return SparseverConfig.from_dict({"method": "sparsever", "model": "/m/draft", "num_speculative_tokens": 3,
                                      **sections})


@pytest.mark.parametrize("section", ["ffn", "moe"])
def test_sparse_ffn_moe_refused_under_cuda_graphs(section):
    config = _config(**{section: {"enabled": True}})
    with pytest.raises(SparseverConfigError, match=rf"{section}\.enabled: .*enforce_eager=True"):
        check_cuda_graphs(config, platform_is_cpu=False, cuda_graphs=True)
    check_cuda_graphs(config, platform_is_cpu=False, cuda_graphs=False)  # eager on a GPU: allowed
    check_cuda_graphs(config, platform_is_cpu=True, cuda_graphs=True)  # vLLM-CPU captures no graphs


@pytest.mark.parametrize(("field", "value"), [("linear_kernel", "sparsever"), ("linear_kernel", "hybrid"),
                                               ("linear_kernel", "vllm-padded"),
                                               ("ffn.dense_kernel", "sparsever"),
                                               ("draft_int8_kernel", "sparsever"), ("draft_int8_kernel", "hybrid"),
                                               ("draft_int4_kernel", "sparsever"), ("draft_int4_kernel", "hybrid")])
def test_cpu_only_kernels_refused_on_a_gpu_before_start(field, value):
    section, _, name = field.rpartition(".")
    config = _config(**({section: {name: value}} if section else {name: value}))
    with pytest.raises(SparseverConfigError, match=rf"^{field}: '{value}' runs on CPU only .*'auto', 'vllm'"):
        check_cpu_only_kernels(config, platform_is_cpu=False)
    check_cpu_only_kernels(config, platform_is_cpu=True)
    check_cpu_only_kernels(_config(), platform_is_cpu=False)  # "auto": resolved per platform


def test_dense_verification_allowed_under_cuda_graphs():
    check_cuda_graphs(_config(), platform_is_cpu=False, cuda_graphs=True)


def test_uses_cuda_graphs_reads_vllm_engine_args():
    from vllm.config import CompilationConfig, CUDAGraphMode

    cls = engine_args_cls()
    assert uses_cuda_graphs(cls(model="m"))  # vLLM's default: graphs on a GPU
    assert not uses_cuda_graphs(cls(model="m", enforce_eager=True))
    assert not uses_cuda_graphs(cls(model="m", compilation_config=CompilationConfig(cudagraph_mode=CUDAGraphMode.NONE)))
    assert uses_cuda_graphs(cls(model="m", compilation_config=CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL)))
    assert not uses_cuda_graphs(cls(model="m", compilation_config={"cudagraph_mode": "NONE"}))
    assert uses_cuda_graphs(cls(model="m", compilation_config={"cudagraph_capture_sizes": [1, 2]}))


def test_distinct_experts_counts_without_unique():
    ids = torch.tensor([[3, 1], [1, -1], [7, 3]], dtype=torch.int32)
    assert int(distinct_experts(ids, 8)) == 3
    assert int(distinct_experts(torch.full((2, 2), -1, dtype=torch.int32), 8)) == 0


def test_device_counters_accumulate_and_are_read_at_summary():
    rt = SparseVerificationRuntime(_config(moe={"enabled": True}))
    rt.record(moe_layers=1)
    rt.record_device(moe_experts_read=torch.tensor([5], dtype=torch.int32))
    rt.record_device(moe_experts_read=torch.tensor([2], dtype=torch.int32))
    assert isinstance(rt.device_stats["moe_experts_read"], torch.Tensor)  # not folded into ints per step
    stats = rt.stats_summary()
    assert stats["moe_experts_read"] == 7 and stats["moe_layers"] == 1
    rt.reset_stats()
    assert "moe_experts_read" not in rt.stats_summary()
