"""Offline `LLM(...)` with method='sparsever': lossless greedy output, metrics, registration.

One engine per configuration (start-up dominates), shared by the tests of this module.
"""

import gc
import os
from pathlib import Path

import pytest

from tiny_models import prompts

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

from conftest import GREEDY_MAX_TOKENS as MAX_TOKENS
from conftest import GREEDY_PROMPTS as NUM_PROMPTS


def _run(model: Path, speculative_config: dict | None, num_prompts: int = NUM_PROMPTS, **engine_kwargs):
    from vllm import LLM, SamplingParams

    from vllm_sparsever.metrics import get_metrics

    llm = LLM(
        model=str(model),
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        max_num_seqs=8,
        seed=0,
        speculative_config=speculative_config,
        **engine_kwargs,
    )
    try:
        outs = llm.generate(prompts(num_prompts), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        metrics = get_metrics(llm) if speculative_config else None
        workers = llm.collective_rpc("sparsever_worker_info") if speculative_config else None
    finally:
        del llm
        gc.collect()
    return tokens, metrics, workers


@pytest.fixture(scope="module")
def registration_log(tmp_path_factory, monkeypatch_module):
    """Registrations of the engines started with it: vLLM's default multiprocess engine (front end,
    engine core, workers), which users run, where the other tests here start theirs in-process."""
    path = tmp_path_factory.mktemp("reg") / "registrations.txt"
    monkeypatch_module.setenv("VLLM_SPARSEVER_REGISTRATION_LOG", str(path))
    monkeypatch_module.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    return path


@pytest.fixture(scope="module")
def baseline(plain_greedy):
    return [tokens for tokens, _ in plain_greedy]


@pytest.fixture(scope="module")
def draft_model_run(registration_log, tiny_target, tiny_draft):
    # linear_kernel "vllm-padded" ("auto" picks it for 16-bit models on AVX512-BF16 CPUs without AMX):
    # the target's and the draft's linears on vLLM's, calls of 1-3 tokens run as 4 rows.
    return _run(
        tiny_target,
        {"method": "sparsever", "model": str(tiny_draft), "num_speculative_tokens": 3, "linear_kernel": "vllm-padded"},
    )


@pytest.fixture(scope="module")
def ngram_run(tiny_target):
    return _run(
        tiny_target,
        {"method": "sparsever", "draft_source": "ngram", "num_speculative_tokens": 4,
         "prompt_lookup_max": 3, "prompt_lookup_min": 1},
    )


@pytest.fixture(scope="module")
def drafting_off_run(tiny_target):
    return _run(tiny_target, {"method": "sparsever", "draft_source": "none"})


def test_baseline_is_not_degenerate(baseline):
    assert len(baseline) == NUM_PROMPTS
    assert all(len(t) == MAX_TOKENS for t in baseline)
    assert len({tuple(t) for t in baseline}) > 1


def test_draft_model_greedy_equals_plain_greedy(baseline, draft_model_run):
    tokens, _, _ = draft_model_run
    assert len(tokens) == len(baseline), f"{len(tokens)} outputs for {len(baseline)} prompts"
    for i, (want, got) in enumerate(zip(baseline, tokens, strict=True)):
        assert got == want, f"prompt {i} differs"


def test_draft_model_metrics(draft_model_run):
    _, m, _ = draft_model_run
    assert m["num_drafts"] > 0 and m["num_draft_tokens"] >= m["num_drafts"]
    # A noisy copy of the target: some drafts accepted, some rejected.
    assert 0 < m["num_accepted_tokens"] < m["num_draft_tokens"]
    assert m["acceptance_rate"] == pytest.approx(m["num_accepted_tokens"] / m["num_draft_tokens"])
    assert m["mean_acceptance_length"] == pytest.approx(1 + m["num_accepted_tokens"] / m["num_drafts"])
    per_pos = m["per_position_acceptance"]
    assert len(per_pos) == 3
    assert sum(m["accepted_per_position"]) == m["num_accepted_tokens"]
    # Position i+1 is only accepted after position i was.
    assert m["accepted_per_position"] == sorted(m["accepted_per_position"], reverse=True)
    assert 0.0 < m["verification_time_share"] < 1.0
    assert m["num_verify_steps"] <= m["num_steps"]
    # attention.dense_kernel "auto": verify steps without a prefill chunk attended with sparsever's
    # kernel (fp32: vLLM's vec layout), and the output above stayed identical to plain greedy.
    assert m["sparsity"]["attn_layers_dense_kernel"] > 0, m["sparsity"]


def test_ngram_greedy_equals_plain_greedy(baseline, ngram_run):
    tokens, m, _ = ngram_run
    assert len(tokens) == len(baseline), f"{len(tokens)} outputs for {len(baseline)} prompts"
    for i, (want, got) in enumerate(zip(baseline, tokens, strict=True)):
        assert got == want, f"prompt {i} differs"
    assert m["num_drafts"] > 0


def test_drafting_off_is_plain_decoding_on_sparsevers_engine(baseline, drafting_off_run):
    # draft_source 'none': the kernels-only baseline of the benchmarks. Nothing drafted or verified, no
    # vLLM drafter run, and plain greedy output.
    tokens, m, workers = drafting_off_run
    assert tokens == baseline
    assert m["num_drafts"] == 0 and m["num_draft_tokens"] == 0 and m["num_verify_steps"] == 0
    assert m["num_steps"] >= MAX_TOKENS
    assert workers and all(w["model_runner"].startswith("Sparsever") for w in workers), workers


def test_plugin_registered_in_front_end_engine_core_and_worker(registration_log, draft_model_run):
    _, _, workers = draft_model_run
    assert [w["model_runner"] for w in workers] == ["SparseverCPUModelRunner"]
    # 4 linears per layer and the LM head, of the target and of the draft model, behind the padding
    # (the greedy output above equals plain greedy).
    assert workers[0]["linear_layers"]["target"] >= 5 and workers[0]["linear_layers"]["draft model"] >= 5, workers
    assert all(w["plugin_registered"] for w in workers)
    worker_pids = [w["pid"] for w in workers]
    entries = [tuple(map(int, line.split())) for line in registration_log.read_text().splitlines()]
    pids = {pid for pid, _ in entries}
    parents = {pid: ppid for pid, ppid in entries}
    assert len(worker_pids) == 1
    worker = worker_pids[0]
    assert worker in pids, "register() did not run in the worker"
    engine_core = parents[worker]
    assert engine_core in pids, "register() did not run in the engine core"
    assert engine_core != os.getpid()


@pytest.fixture(scope="module")
def tensor_parallel_run(registration_log, tiny_target, tiny_draft, monkeypatch_module):
    # Two ranks on two cores: no core reserved for the front end, one OpenMP thread per rank.
    monkeypatch_module.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    monkeypatch_module.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    # The target's and the draft model's dense linears on dense_linear ("auto" keeps an fp32 target on
    # vLLM's): sharded weights, the row-parallel bias on rank 0 only, then the all-reduce.
    return _run(
        tiny_target,
        {"method": "sparsever", "model": str(tiny_draft), "num_speculative_tokens": 3, "linear_kernel": "sparsever"},
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
    )


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_tensor_parallel_greedy_equals_plain_greedy_and_every_rank_registers(
    baseline, tensor_parallel_run, registration_log
):
    tokens, metrics, workers = tensor_parallel_run
    assert len(tokens) == len(baseline), f"{len(tokens)} outputs for {len(baseline)} prompts"
    for i, (want, got) in enumerate(zip(baseline, tokens, strict=True)):
        assert got == want, f"prompt {i} differs"
    assert sorted(w["rank"] for w in workers) == [0, 1]
    assert all(w["model_runner"] == "SparseverCPUModelRunner" for w in workers)
    # 4 linears per layer (QKV, output, gate/up, down) and the LM head, on each rank.
    assert all(w["linear_layers"]["target"] >= 5 and w["linear_layers"]["draft model"] >= 5 for w in workers), workers
    logged = {int(line.split()[0]) for line in registration_log.read_text().splitlines()}
    assert {w["pid"] for w in workers} <= logged
    assert len(metrics["ranks"]) == 2
    assert metrics["num_drafts"] > 0


def test_ray_on_cpu_fails_before_start_with_a_clear_message(tiny_target):
    from vllm import LLM

    from vllm_sparsever.config import SparseverConfigError

    with pytest.raises(SparseverConfigError, match="distributed_executor_backend.*Ray"):
        LLM(model=str(tiny_target), distributed_executor_backend="ray", enforce_eager=True,
            max_model_len=512,
            speculative_config={"method": "sparsever", "model": str(tiny_target), "num_speculative_tokens": 2})
