"""The V1 model runner's hooks and per-step state the sparsever runner reads (compat.runner)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_sparsever.compat import runner as compat_runner
from vllm_sparsever.compat import worker as compat_worker


@pytest.fixture(scope="module")
def runner_classes():
    _, cpu_runner = compat_worker.cpu_worker_classes()
    _, gpu_runner = compat_worker.gpu_worker_classes()  # imports on CPU; checked by signature only
    return {"cpu": cpu_runner, "gpu": gpu_runner}


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_runner_hooks_have_the_assumed_signatures(runner_classes, platform):
    compat_runner.check_runner_hooks(runner_classes[platform])


def test_check_runner_hooks_rejects_a_changed_hook(runner_classes):
    class Changed(runner_classes["cpu"]):
        def _prepare_inputs(self, scheduler_output, num_tokens_per_req):  # renamed parameter
            raise AssertionError

    with pytest.raises(RuntimeError, match="_prepare_inputs"):
        compat_runner.check_runner_hooks(Changed)


def test_runner_loads_the_drafter_through_drafter_load_model(runner_classes):
    """`intercept_drafter_load` relies on the runner calling `self.drafter.load_model(...)`."""
    import inspect

    for cls in runner_classes.values():
        names = inspect.unwrap(cls.load_model).__code__.co_names  # unwrap vLLM's tracing decorator
        assert "drafter" in names and "load_model" in names, cls


def test_runner_sets_use_async_scheduling():
    """`async_scheduling(runner)` reads `runner.use_async_scheduling`, set by the runner's constructor
    (a rename would make it read False and let a late proposer start under async scheduling)."""
    import inspect

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert "self.use_async_scheduling = " in inspect.getsource(GPUModelRunner.__init__)
    assert compat_runner.async_scheduling(SimpleNamespace(use_async_scheduling=True))
    assert not compat_runner.async_scheduling(SimpleNamespace(use_async_scheduling=False))


def _input_batch(max_num_reqs=4, block_size=32, max_blocks=8):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

    batch = InputBatch(max_num_reqs=max_num_reqs, max_model_len=max_blocks * block_size,
                       max_num_batched_tokens=64, device=torch.device("cpu"), vocab_size=100,
                       block_sizes=[block_size], max_num_blocks_per_req=[max_blocks])
    for i, (computed, blocks) in enumerate([(40, [7, 3]), (5, [9])]):
        batch.add_request(CachedRequestState(
            req_id=f"r{i}", prompt_token_ids=list(range(computed + 1)), mm_features=[],
            sampling_params=SamplingParams(temperature=0.0), generator=None, block_ids=(blocks,),
            num_computed_tokens=computed, output_token_ids=[],
        ))
    return batch


def test_input_batch_view_reads_a_real_input_batch():
    view = compat_runner.input_batch_view(SimpleNamespace(input_batch=_input_batch()))
    assert view.req_ids == ["r0", "r1"]
    assert view.num_reqs == 2
    assert isinstance(view.num_computed_tokens, np.ndarray)
    assert view.num_computed_tokens[:2].tolist() == [40, 5]
    assert isinstance(view.block_table_cpu, torch.Tensor) and view.block_table_cpu.device.type == "cpu"
    assert view.block_table_cpu[0, :2].tolist() == [7, 3] and view.block_table_cpu[1, 0] == 9
    assert view.block_size == 32
    with pytest.raises(AttributeError):  # frozen
        view.num_reqs = 3


def test_layers_block_table_reads_the_groups_block_table():
    group = lambda names, gid: SimpleNamespace(layer_names=names, kv_cache_group_id=gid)  # noqa: E731
    runner = SimpleNamespace(input_batch=_input_batch(),
                             attn_groups=[[group(["t.0", "t.1"], 0)], [group(["d.0", "d.1"], 0)]])
    table, block_size = compat_runner.layers_block_table(runner, ["d.0", "d.1"])
    assert block_size == 32 and table[0, :2].tolist() == [7, 3] and table[1, 0] == 9
    assert compat_runner.layers_block_table(runner, ["t.1", "d.0"]) is None  # two groups


def test_scheduled_drafts_field_of_scheduler_output():
    from vllm.v1.core.sched.output import SchedulerOutput

    out = SchedulerOutput.make_empty()
    out.scheduled_spec_decode_tokens["r0"] = [5, 6, 7]
    assert compat_runner.scheduled_drafts(out) == {"r0": [5, 6, 7]}


def test_prompt_tokens_to_compute_of_scheduler_output():
    """Per newly scheduled request: its prompt less the prefix cache's tokens (vLLM's NewRequestData)."""
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    out = SchedulerOutput.make_empty()
    fields = {f: None for f in NewRequestData.__dataclass_fields__}
    out.scheduled_new_reqs.append(NewRequestData(**{**fields, "req_id": "a", "prompt_token_ids": list(range(300)),
                                                    "num_computed_tokens": 256, "mm_features": [],
                                                    "block_ids": ([],)}))
    out.scheduled_new_reqs.append(NewRequestData(**{**fields, "req_id": "b", "prompt_token_ids": list(range(40)),
                                                    "num_computed_tokens": 0, "mm_features": [],
                                                    "block_ids": ([],)}))
    assert compat_runner.prompt_tokens_to_compute(out) == {"a": 44, "b": 40}
    assert compat_runner.prompt_tokens_to_compute(SchedulerOutput.make_empty()) == {}


def test_finished_request_ids_field_of_scheduler_output():
    from vllm.v1.core.sched.interface import SchedulerInterface
    from vllm.v1.core.sched.output import SchedulerOutput

    out = SchedulerOutput.make_empty()
    out.finished_req_ids.add("r9")
    assert compat_runner.finished_request_ids(out) == {"r9"}
    # The scheduler keeps stepping while finished ids wait to reach the workers.
    assert "has_finished_requests" in SchedulerInterface.has_requests.__code__.co_names


def test_sampled_tokens_of_model_runner_output():
    from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

    out = ModelRunnerOutput(req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1},
                            sampled_token_ids=[[1, 2], []])
    assert compat_runner.sampled_tokens(out) == ({"a": 0, "b": 1}, [[1, 2], []])
    # Async outputs carry no tokens at this point.
    assert "sampled_token_ids" not in vars(AsyncModelRunnerOutput)
    assert compat_runner.sampled_tokens(SimpleNamespace()) is None
    assert compat_runner.sampled_tokens(None) is None


class _Drafter:
    def __init__(self, calls):
        self.calls = calls

    def load_model(self, target):
        self.calls.append(("load", target))


def test_intercept_drafter_load_runs_before_and_undoes():
    calls = []
    drafter = _Drafter(calls)
    undo = compat_runner.intercept_drafter_load(SimpleNamespace(drafter=drafter),
                                                before_load=lambda: calls.append("before"))
    drafter.load_model("target")
    assert calls == ["before", ("load", "target")]
    undo()
    assert "load_model" not in vars(drafter)  # back to the class's method
    drafter.load_model("again")
    assert calls[-1] == ("load", "again") and calls.count("before") == 1


def test_intercept_drafter_load_loads_inside_the_given_context():
    import contextlib

    calls = []

    @contextlib.contextmanager
    def during():
        calls.append("enter")
        yield
        calls.append("exit")

    drafter = _Drafter(calls)
    compat_runner.intercept_drafter_load(SimpleNamespace(drafter=drafter), before_load=lambda: calls.append("before"),
                                         during_load=during)
    drafter.load_model("target")
    assert calls == ["before", "enter", ("load", "target"), "exit"]


def test_intercept_drafter_load_without_drafter_is_a_noop():
    undo = compat_runner.intercept_drafter_load(SimpleNamespace(), before_load=pytest.fail)
    undo()


@pytest.mark.parametrize("linear_kernel", ["vllm", "sparsever", "hybrid", "vllm-padded"])
def test_target_load_hooks_close_before_the_drafter_loads(linear_kernel):
    """setup.target_load_hooks: the FFN hook is active while the target loads and closed when the
    drafter loads (its model loads stock), except that under linear_kernel "sparsever" / "hybrid" the
    draft model's linears keep their plain weights too (dense_linear) while it loads, and under
    "vllm-padded" they get the padded forward over vLLM's own."""
    import torch
    import vllm.model_executor.layers.utils as layer_utils

    from vllm_sparsever.verification.lossless.linear_kernel import sparsever_cpu_linear
    from vllm_sparsever.verification.sparse.setup import target_load_hooks

    stock = layer_utils.dispatch_cpu_unquantized_gemm
    seen = []

    class Drafter:
        def load_model(self, target):
            seen.append(layer_utils.dispatch_cpu_unquantized_gemm is stock)
            layer = torch.nn.Module()
            layer.weight = torch.nn.Parameter(torch.randn(4, 8, dtype=torch.bfloat16), requires_grad=False)
            layer_utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
            # dense_linear's forward: the op itself, or (hybrid) its switch to vLLM's packed weight,
            # or (vllm-padded) vLLM's forward behind the padding
            forward = getattr(layer, "cpu_linear", None)
            name = getattr(forward, "__qualname__", "")
            seen.append(forward is sparsever_cpu_linear
                        or name.startswith("hybrid_cpu_linear") and layer.weight.shape == (4, 8)
                        or name.startswith("padded_cpu_linear"))

    runtime = SimpleNamespace(started_with={"ffn": True, "moe": False}, ffn=SimpleNamespace(weights="copy"),
                              linear_kernel=linear_kernel, linear_layers={}, draft_int8_kernel="vllm",
                              draft_int4_kernel="vllm")
    runner = SimpleNamespace(drafter=Drafter())
    with target_load_hooks(runtime, runner):
        assert layer_utils.dispatch_cpu_unquantized_gemm is not stock  # target loading
        runner.drafter.load_model(None)
    assert seen == ([True, False] if linear_kernel == "vllm" else [False, True])
    assert runtime.linear_layers == ({} if linear_kernel == "vllm" else {"draft model": 1})
    assert "load_model" not in vars(runner.drafter)
    assert layer_utils.dispatch_cpu_unquantized_gemm is stock


def test_windowed_block_table_keeps_the_sink_and_the_recent_blocks():
    from vllm_sparsever.step import windowed_block_table

    table = torch.arange(100, 110, dtype=torch.int32).repeat(3, 1)  # 10 blocks of 4 positions per request
    seq_lens = torch.tensor([40, 40, 9], dtype=torch.int32)
    firsts = torch.tensor([39, 20, 8])  # a decode-like query; a run of queries from 20; a short request
    out, lens = windowed_block_table(table, seq_lens, firsts, 4, sink=1, recent=8)
    # Request 0: block 0, then blocks 8-9 (positions 32-39 hold the last 8); 4 + 8 positions read.
    assert out[0, :3].tolist() == [100, 108, 109] and int(lens[0]) == 12
    # Request 1: its queries start at 20 (block 5): blocks 5-9 follow the sink.
    assert out[1, :6].tolist() == [100, 105, 106, 107, 108, 109] and int(lens[1]) == 4 + 20
    # Request 2: the window reaches back to the sink: unchanged.
    assert torch.equal(out[2], table[2]) and int(lens[2]) == 9
    assert torch.equal(table, torch.arange(100, 110, dtype=torch.int32).repeat(3, 1))  # not written in place
    # The queries keep their places at the end: each position p >= the window's start maps to p - offset.
    offset = (8 - 1) * 4
    assert int(lens[0]) - 1 == 39 - offset


def test_committed_tokens_of_a_real_input_batch():
    batch = _input_batch()
    req_ids, num_tokens, token_ids = compat_runner.committed_tokens(SimpleNamespace(input_batch=batch))
    assert req_ids == ["r0", "r1"] and num_tokens.tolist() == [41, 6]  # prompt lengths, no output yet
    assert token_ids[1, :6].tolist() == list(range(6))


def test_eos_token_ids_of_the_model_config():
    import dataclasses

    from vllm.config import ModelConfig

    assert "hf_text_config" in {f.name for f in dataclasses.fields(ModelConfig)}
    assert callable(ModelConfig.try_get_generation_config)
    config = SimpleNamespace(hf_text_config=SimpleNamespace(eos_token_id=2),
                             try_get_generation_config=lambda: {"eos_token_id": [2, 7]})
    assert compat_runner.eos_token_ids(config) == {2, 7}
    config = SimpleNamespace(hf_text_config=SimpleNamespace(), try_get_generation_config=lambda: {})
    assert compat_runner.eos_token_ids(config) == set()
