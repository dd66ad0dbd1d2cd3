"""Sparse verification inside a real engine (tiny fp32 Llama, n-gram drafts): one engine start.

The engine starts with attention and FFN sparsity set up, with the reference check hook on
(`VLLM_SPARSEVER_CHECK_REFERENCE=1`: each sparse layer also runs the PyTorch reference on its real
inputs and records the largest difference); the tests switch policies at run time.
"""

import contextlib
import gc
import os

import pytest

from tiny_models import make_tiny_llama, prompts

from vllm_sparsever.compat.engine import shutdown_llm

# Engines here outlive others started and stopped beside them (conftest.multiprocess_engine).
pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.usefixtures("multiprocess_engines")]

NUM_LAYERS = 4
# ~700-token prompts: 5-6 KV blocks of 128, so top-1 selection (+ sink + local) skips blocks.
LONG_PROMPTS = [p * 55 for p in prompts(3, length=12, seed=3)]
ATTENTION = {"enabled": True, "min_context_len": 256, "top_k_blocks": 1, "anchor_layers": [0, 2]}
FFN = {"enabled": True, "keep_ratio": 0.25, "max_verify_requests": 4}


@contextlib.contextmanager
def _env(**overrides):
    """Environment for an engine start (inherited by its worker processes)."""
    saved = {k: os.environ.get(k) for k in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def _start(target, sections, env=None, **engine_args):
    from vllm import LLM

    drafting = {} if "model" in sections else {"prompt_lookup_max": 3}  # n-gram unless a draft model
    with _env(VLLM_SPARSEVER_CHECK_REFERENCE="1", **(env or {})):
        return LLM(
            model=str(target), dtype="float32", enforce_eager=True, max_model_len=2048,
            max_num_seqs=4, seed=0,
            speculative_config={"method": "sparsever", "num_speculative_tokens": 3, **drafting, **sections},
            **engine_args,
        )


@pytest.fixture(scope="module")
def target4(tiny_dir):
    return make_tiny_llama(tiny_dir / "target4", seed=0, num_layers=NUM_LAYERS)


@pytest.fixture(scope="module")
def sparse_llm(target4):
    # Every dense linear of the target on sparsever's dense_linear op (linear_kernel; "auto" keeps an fp32
    # target on vLLM's): "all off" below is then lossless through it, prefill and verify steps alike.
    llm = _start(target4, {"attention": {**ATTENTION, "kernel": "sparsever"}, "ffn": FFN, "linear_kernel": "sparsever"})
    yield llm, target4
    shutdown_llm(llm)  # explicitly: a finalizer's shutdown at teardown may force-kill a slow engine core
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def plain_greedy_long(target4):
    return _plain_greedy(target4, LONG_PROMPTS)


def _run(llm, prompt_list, max_tokens=24, **sections):
    from vllm import SamplingParams

    from vllm_sparsever.metrics import get_metrics, reset_metrics, set_sparsity

    set_sparsity(llm, **sections)
    reset_metrics(llm)
    outs = llm.generate(prompt_list, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return [list(o.outputs[0].token_ids) for o in outs], get_metrics(llm)


def _plain_greedy(target, prompt_list, max_tokens=24):
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(target), dtype="float32", enforce_eager=True, max_model_len=2048,
              max_num_seqs=4, seed=0)
    try:
        outs = llm.generate(prompt_list, SamplingParams(temperature=0.0, max_tokens=max_tokens))
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        shutdown_llm(llm)
        del llm
        gc.collect()


def test_all_off_is_identical_to_plain_greedy(sparse_llm, plain_greedy_long):
    llm, _ = sparse_llm
    info = llm.collective_rpc("sparsever_sparsity_info")[0]
    # 4 linears per layer (QKV, output, gate/up, down), the LM head and the (untied) input embedding, whose
    # table vLLM-CPU prepares the same way (n-gram drafts: no draft model)
    assert info["linear_kernel"] == "sparsever", info
    assert info["linear_layers"] == {"target": 4 * NUM_LAYERS + 2}, info["linear_layers"]
    tokens, metrics = _run(llm, LONG_PROMPTS, attention={"enabled": False}, ffn={"enabled": False})
    assert metrics["num_verify_steps"] > 0
    assert not any(k.endswith("_sparse") for k in metrics["sparsity"]), metrics["sparsity"]
    assert tokens == plain_greedy_long


def _assert_sparse_attention_matches_reference(metrics):
    s = metrics["sparsity"]
    assert s.get("attention_fallbacks", 0) == 0, s
    # Every verify step is sparse in every layer; anchors 0 and 2 select, layers 1 and 3 reuse.
    assert s["attn_layers_sparse"] == NUM_LAYERS * metrics["num_verify_steps"], (s, metrics)
    assert s["attn_selections"] * 2 == s["attn_layers_sparse"]
    assert 0 < s["attn_kv_blocks_read"] < s["attn_kv_blocks_dense"]
    # The kernel computed what the reference computes on the same selection, and the key summaries
    # it selected from equal (sparsever kernel: recomputed) or bound (vllm kernel: folded) the keys
    # in the cache.
    assert s["attn_reference_checks"] == s["attn_layers_sparse"]
    assert s["attn_reference_max_abs_err"] < 1e-4, s
    assert s["attn_summaries_reference_max_abs_err"] == 0.0, s


def test_sparse_attention_matches_reference_and_reads_fewer_blocks(sparse_llm):
    llm, _ = sparse_llm
    _, metrics = _run(llm, LONG_PROMPTS, attention=ATTENTION, ffn={"enabled": False})
    _assert_sparse_attention_matches_reference(metrics)
    assert "ffn_layers_sparse" not in metrics["sparsity"]


def test_sparse_ffn_matches_reference_and_reads_fewer_neurons(sparse_llm):
    llm, _ = sparse_llm
    # "auto" with the tiny model's gate rows (far below 4 MiB): the op streams the gate itself.
    info = llm.collective_rpc("sparsever_sparsity_info")[0]
    assert info["ffn_gate"] == ["kernel"]
    assert info["ffn_dense_kernel"] == "vllm"  # "copy" weights: dense steps on the stock MLP (its linears)
    _, metrics = _run(llm, LONG_PROMPTS, attention={"enabled": False}, ffn=FFN)
    s = metrics["sparsity"]
    assert s.get("ffn_fallbacks", 0) == 0, s
    assert s["ffn_layers_sparse"] == NUM_LAYERS * metrics["num_verify_steps"], (s, metrics)
    # One neuron set per request: the step reads the union, at most requests * keep.
    assert 0 < s["ffn_neurons_read"] <= 3 * 0.25 * s["ffn_neurons_dense"]
    assert s["ffn_reference_checks"] == s["ffn_layers_sparse"]
    assert s["ffn_reference_max_abs_err"] < 1e-4, s
    assert "attn_layers_sparse" not in s


def test_short_context_attention_stays_dense(sparse_llm):
    """Below min_context_len no attention layer runs sparse."""
    llm, _ = sparse_llm
    tokens, metrics = _run(llm, prompts(6), max_tokens=32,
                           attention={**ATTENTION, "min_context_len": 4096}, ffn={"enabled": False})
    assert "attn_layers_sparse" not in metrics["sparsity"]
    assert metrics["num_verify_steps"] > 0


def test_run_time_switch_cannot_enable_what_start_did_not_set_up(sparse_llm):
    llm, _ = sparse_llm
    from vllm_sparsever.metrics import set_sparsity

    with pytest.raises(Exception, match=r"moe\.enabled.*off at start"):
        set_sparsity(llm, moe={"enabled": True})
    with pytest.raises(Exception, match=r"ffn\.keep_ratio"):
        set_sparsity(llm, ffn={"enabled": True, "keep_ratio": 2.0})
    with pytest.raises(Exception, match=r"attention\.kernel: chosen at start"):
        set_sparsity(llm, attention={**ATTENTION, "kernel": "vllm"})


# ---- attention.kernel = "vllm": vLLM's attention kernel over compacted block tables -----------------


# This engine also sets up the approximate, input-sparse FFN gate (the other engines use the dense one)
# over "shared" weights: one plain copy, whose dense steps of up to 64 fp32 tokens run the op at keep =
# I (so the identity test below checks that path against plain greedy too).
FFN_INPUT_SPARSE = {**FFN, "gate": "input_sparse", "gate_input_keep_ratio": 0.5, "weights": "shared"}


@pytest.fixture(scope="module")
def vllm_kernel_llm(target4):
    llm = _start(target4, {"attention": {**ATTENTION, "kernel": "vllm"}, "ffn": FFN_INPUT_SPARSE})
    yield llm
    shutdown_llm(llm)  # explicitly: a finalizer's shutdown at teardown may force-kill a slow engine core
    del llm
    gc.collect()


def test_vllm_kernel_sparse_attention_matches_reference(vllm_kernel_llm):
    """vLLM's kernel over the compacted tables = the reference over the kept blocks (one selection
    shared by the KV heads)."""
    _, metrics = _run(vllm_kernel_llm, LONG_PROMPTS, attention={**ATTENTION, "kernel": "vllm"},
                      ffn={"enabled": False})
    _assert_sparse_attention_matches_reference(metrics)


def test_input_sparse_gate_ffn_matches_reference_and_reads_half_the_gate(vllm_kernel_llm):
    """ffn.gate "input_sparse": each request's gate from its top half of hidden channels (the
    transposed gate's rows), then the gated op; both equal the references on the same inputs."""
    info = vllm_kernel_llm.collective_rpc("sparsever_sparsity_info")[0]
    assert info["ffn_gate"] == ["input_sparse"]
    assert info["ffn_dense_op_max_tokens"] == 64  # "shared" fp32 weights: the op serves dense steps
    assert info["ffn_dense_kernel"] == "sparsever"  # ffn.dense_kernel "auto" with "shared" weights
    _, metrics = _run(vllm_kernel_llm, LONG_PROMPTS, attention={"enabled": False}, ffn=FFN_INPUT_SPARSE)
    s = metrics["sparsity"]
    assert s.get("ffn_fallbacks", 0) == 0, s
    assert s["ffn_layers_sparse"] == NUM_LAYERS * metrics["num_verify_steps"] > 0, (s, metrics)
    assert 0 < s["ffn_neurons_read"] <= 3 * 0.25 * s["ffn_neurons_dense"]
    # One channel set per request: at most requests * half the hidden channels per layer.
    assert 0 < s["ffn_gate_channels_read"] <= 3 * 0.5 * s["ffn_gate_channels_dense"]
    assert s["ffn_reference_checks"] == s["ffn_layers_sparse"]
    assert s["ffn_reference_max_abs_err"] < 1e-4, s


def test_plan_follows_the_target_when_the_draft_has_other_shapes(target4, tiny_dir):
    """A draft model with another head size gets its own attention group (and metadata builder) in
    vLLM; the step plan (compacted lengths, vLLM's work split) must still be the target's."""
    draft = make_tiny_llama(tiny_dir / "draft_other_shapes", seed=1, num_layers=2, num_heads=2,
                            num_kv_heads=1)  # head size 64 and 1 KV head vs the target's 32 and 2
    llm = _start(target4, {"model": str(draft), "attention": {**ATTENTION, "kernel": "vllm"}})
    try:
        _, metrics = _run(llm, LONG_PROMPTS, attention={**ATTENTION, "kernel": "vllm"})
    finally:
        shutdown_llm(llm)
        del llm
        gc.collect()
    s = metrics["sparsity"]
    # No layer saw a plan made for other shapes (that falls back as "geometry_mismatch"); every
    # step planned sparse ran sparse in every target layer (a step with a prefill chunk stays dense).
    assert s.get("attention_fallbacks", 0) == 0, s
    assert s["attn_layers_sparse"] > 0 and s["attn_layers_sparse"] % NUM_LAYERS == 0, s
    assert 0 < s["attn_kv_blocks_read"] < s["attn_kv_blocks_dense"]
    assert s["attn_reference_checks"] == s["attn_layers_sparse"]
    assert s["attn_reference_max_abs_err"] < 1e-4, s


def test_vllm_kernel_keeping_every_block_is_identical_to_plain_greedy(vllm_kernel_llm, plain_greedy_long):
    """A budget that covers every block leaves the tables as they are: the sparse path then runs
    exactly vLLM's dense attention, so the output is token-identical to plain greedy (fp32). The MLPs
    are dense here too, on one plain copy ("shared"): the op at keep = I on verify steps."""
    tokens, metrics = _run(vllm_kernel_llm, LONG_PROMPTS, attention={**ATTENTION, "kernel": "vllm", "top_k_blocks": 64},
                           ffn={"enabled": False})
    assert metrics["sparsity"]["attn_layers_sparse"] == NUM_LAYERS * metrics["num_verify_steps"]
    assert metrics["sparsity"]["attn_kv_blocks_read"] == metrics["sparsity"]["attn_kv_blocks_dense"]
    assert tokens == plain_greedy_long


# ---- tensor parallelism: each rank attends over its heads and selects among its own neurons ----------


@pytest.fixture(scope="module")
def tp_llm(target4):
    # Two ranks on two cores: no core reserved for the front end, one OpenMP thread per rank.
    # The gate on vLLM's stock dense linear here ("auto" streams gates this small in the op itself,
    # as sparse_llm does): both FFN paths are checked against the reference, gate included.
    llm = _start(target4, {"attention": ATTENTION, "ffn": {**FFN, "gate": "stock"}}, tensor_parallel_size=2,
                 distributed_executor_backend="mp",
                 env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    yield llm
    shutdown_llm(llm)  # explicitly: a finalizer's shutdown at teardown may force-kill a slow engine core
    del llm
    gc.collect()


def test_tensor_parallel_sparse_verification_matches_reference_on_every_rank(tp_llm):
    assert [info["ffn_gate"] for info in tp_llm.collective_rpc("sparsever_sparsity_info")] == [["stock"]] * 2
    _, metrics = _run(tp_llm, LONG_PROMPTS, attention=ATTENTION, ffn=FFN)
    ranks = metrics["ranks"]
    assert len(ranks) == 2
    for rank in ranks:
        steps, s = rank["num_verify_steps"], rank["sparsity"]
        assert steps == metrics["num_verify_steps"] > 0
        assert s.get("attention_fallbacks", 0) == 0 and s.get("ffn_fallbacks", 0) == 0, s
        assert s["attn_layers_sparse"] == s["ffn_layers_sparse"] == NUM_LAYERS * steps, s
        assert 0 < s["attn_kv_blocks_read"] < s["attn_kv_blocks_dense"]
        assert 0 < s["ffn_neurons_read"] <= 3 * 0.25 * s["ffn_neurons_dense"]
        # Each rank's share (its heads; its neurons before the all-reduce) equals the reference.
        assert s["attn_reference_checks"] == s["ffn_reference_checks"] == s["attn_layers_sparse"]
        assert s["attn_reference_max_abs_err"] < 1e-4 and s["ffn_reference_max_abs_err"] < 1e-4, s
        # Each rank holds half the neurons (tiny Llama: intermediate 256) and one of the 2 KV heads.
        assert s["ffn_neurons_dense"] == NUM_LAYERS * steps * 256 // 2
