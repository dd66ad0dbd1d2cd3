"""`vllm-sparsever calibrate` on tiny random models (HF transformers, CPU, no vLLM engine; fast).

Blocks of 16 tokens and ~1000-token texts keep it quick while leaving the selection a real choice.
"""

import math
import statistics
from pathlib import Path

import pytest
import torch
from tiny_models import _VOCAB_WORDS, make_tiny_llama

from vllm_sparsever import reference
from vllm_sparsever.offline.calibration import CalibrationError, CalibrationOptions
from vllm_sparsever.offline.calibration.calibrate import (
    build_profile,
    calibrate,
    round_keep_ratio,
)
from vllm_sparsever.offline.calibration.capture import (
    ffn_group_keep_shares,
    greedy_anchors,
    plan_windows,
)
from vllm_sparsever.verification.sparse.profile import CalibrationProfile, default_profile_path

NUM_LAYERS = 4
BLOCK = 16
MAX_TOKENS = 1024
CAPTURED_LAYER = 1


def _tiny_mixtral(path: Path) -> Path:
    from tiny_moe import make_tiny_mixtral

    return make_tiny_mixtral(path, num_layers=3, top_k=3)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("calibration")


@pytest.fixture(scope="module")
def text_file(workdir) -> Path:
    # Word-level text with repeated phrases (so attention has structure), > MAX_TOKENS tokens.
    g = torch.Generator().manual_seed(7)
    phrases = [[_VOCAB_WORDS[i] for i in torch.randint(0, 200, (8,), generator=g).tolist()]
               for _ in range(40)]  # fmt: skip
    words = []
    while len(words) < MAX_TOKENS + 200:
        words += phrases[int(torch.randint(0, len(phrases), (1,), generator=g))]
    path = workdir / "text.txt"
    path.write_text(" ".join(words))
    return path


@pytest.fixture(scope="module")
def llama(workdir) -> Path:
    return make_tiny_llama(workdir / "llama", seed=0, num_layers=NUM_LAYERS)


@pytest.fixture(scope="module")
def mixtral(workdir) -> Path:
    return _tiny_mixtral(workdir / "mixtral")


def _options(text_file, **kw) -> CalibrationOptions:
    base = {"text_file": str(text_file), "block_size": BLOCK, "max_tokens": MAX_TOKENS,
            "num_windows": 6, "show_progress": False}
    base.update(kw)
    return CalibrationOptions(**base)


@pytest.fixture(scope="module")
def llama_run(llama, text_file):
    return calibrate(str(llama), _options(text_file, keep_qk_layers=(0, CAPTURED_LAYER)), write=False)


# ---- the command ---------------------------------------------------------------------------------


def test_cli_writes_a_profile_that_loads(llama, text_file, workdir, monkeypatch, capsys):
    from vllm_sparsever.cli import main

    monkeypatch.setenv("SPARSEVER_PROFILES_ROOT", str(workdir / "profiles"))
    rc = main(["calibrate", str(llama), "--text-file", str(text_file), "--block-size", str(BLOCK),
               "--max-tokens", str(MAX_TOKENS), "--num-windows", "4", "--no-progress"])  # fmt: skip
    assert rc == 0
    path = default_profile_path(str(llama))  # where the worker looks for it
    assert path.is_file() and path.parent == workdir / "profiles"
    profile = CalibrationProfile.load(path)
    profile.validate()
    assert profile.model == str(llama)
    assert profile.num_layers == NUM_LAYERS
    assert profile.anchor_layers[0] == 0
    assert profile.moe_ratio_thresholds is None  # dense model
    assert len(profile.ffn_keep_ratios) == NUM_LAYERS
    assert all(0.0 < r <= 1.0 for r in profile.ffn_keep_ratios)
    assert len(profile.details["attention"]["jaccard_to_anchor"]) == NUM_LAYERS
    out = capsys.readouterr().out
    assert "anchors" in out and str(path) in out


def test_output_option_and_short_text(llama, workdir, text_file):
    out = workdir / "explicit" / "p.json"
    result = calibrate(str(llama), _options(text_file, max_tokens=250), out)
    assert result.path == out and CalibrationProfile.load(out).num_layers == NUM_LAYERS
    # 250 tokens of 16-token blocks: at most 14 middle blocks, so top-16 is scaled down.
    att = result.profile.details["attention"]
    assert att["top_k_scaled_down"] and att["top_k_blocks"] < 16
    with pytest.raises(CalibrationError, match="needs at least"):
        calibrate(str(llama), _options(text_file, max_tokens=40), write=False)


# ---- attention anchors ---------------------------------------------------------------------------


def test_min_jaccard_extremes(llama_run):
    opts = _options("unused")
    opts.min_jaccard = 0.0
    assert build_profile(llama_run.capture, opts, "m").anchor_layers == [0]
    opts.min_jaccard = 1.01
    assert build_profile(llama_run.capture, opts, "m").anchor_layers == list(range(NUM_LAYERS))
    # Thresholds between: anchors follow the recorded Jaccard to the current anchor.
    profile = llama_run.profile
    sims = profile.details["attention"]["jaccard_to_anchor"]
    assert sims[0] is None and all(0.0 <= s <= 1.0 for s in sims[1:])
    for layer in range(1, NUM_LAYERS):
        assert (layer in profile.anchor_layers) == (sims[layer] < CalibrationOptions().min_jaccard)


def test_greedy_anchors_by_hand():
    j = [[1.0, 0.9, 0.3, 0.8],
         [0.9, 1.0, 0.4, 0.2],
         [0.3, 0.4, 1.0, 0.7],
         [0.8, 0.2, 0.7, 1.0]]  # fmt: skip
    # 1 reuses 0 (0.9); 2 vs anchor 0: 0.3 -> anchor; 3 vs anchor 2: 0.7 -> reuses.
    assert greedy_anchors(j, 0.5) == ([0, 2], [None, 0.9, 0.3, 0.7])
    assert greedy_anchors(j, 0.75) == ([0, 2, 3], [None, 0.9, 0.3, 0.7])


def test_selection_matches_reference_on_a_paged_cache(llama_run):
    """The selection calibration measures = reference.select_kv_blocks on a vLLM-like paged cache
    built from the captured keys (shuffled physical blocks, summaries from update_block_key_summaries)."""
    stats = llama_run.capture.layers[CAPTURED_LAYER]
    plan = llama_run.capture.plan
    q, k = stats.qk  # [Hq, T, D], [Hkv, T, D]
    hkv, num_tokens, d = k.shape
    nblocks = math.ceil(num_tokens / BLOCK)
    assert len(plan.ctx_lens) >= 4
    g = torch.Generator().manual_seed(0)
    for r, ctx in enumerate(plan.ctx_lens):
        seq_len = ctx + plan.window
        n_seq = math.ceil(seq_len / BLOCK)
        phys = torch.randperm(nblocks + 3, generator=g)[:n_seq]
        key_cache = torch.randn(nblocks + 3, hkv, BLOCK, d, generator=g)  # stale garbage everywhere
        pos = torch.arange(seq_len)
        slots = phys[pos // BLOCK] * BLOCK + pos % BLOCK
        key_cache[phys[pos // BLOCK], :, pos % BLOCK] = k[:, :seq_len].permute(1, 0, 2)
        key_min = torch.zeros(nblocks + 3, hkv, d)
        key_max = torch.zeros(nblocks + 3, hkv, d)
        reference.update_block_key_summaries(key_cache, slots, BLOCK, key_min, key_max)
        query = q[:, ctx:seq_len].permute(1, 0, 2)  # the window's tokens, [q_len, Hq, D]
        pooled = reference.pool_queries(query, torch.tensor([0, plan.window]))
        sel = torch.empty(1, hkv, plan.num_slots, dtype=torch.int32)
        num = torch.empty(1, hkv, dtype=torch.int32)
        reference.select_kv_blocks(
            pooled, key_min, key_max, phys.to(torch.int32).unsqueeze(0),
            torch.tensor([seq_len], dtype=torch.int32), torch.tensor([plan.window], dtype=torch.int32),
            BLOCK, plan.top_k, plan.num_sink, plan.num_local, sel, num,
        )  # fmt: skip
        assert torch.equal(num[0], stats.num_selected[r])
        assert torch.equal(sel[0], stats.selected[r])
        # Every window has a real choice (more middle blocks than top-k).
        assert math.ceil(ctx / BLOCK) > plan.num_slots


def test_captured_queries_and_keys_are_post_rope(llama, llama_run):
    """Layer 0's captured q/k equal q_proj/k_proj of the normed embeddings, rotated."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = AutoModelForCausalLM.from_pretrained(str(llama), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(llama))
    text = Path(llama_run.profile.details["text"]["text_file"]).read_text()
    ids = tok(text, return_tensors="pt")["input_ids"][:, :MAX_TOKENS]
    with torch.no_grad():
        layer = model.model.layers[0]
        h = layer.input_layernorm(model.model.embed_tokens(ids))
        attn = layer.self_attn
        q = attn.q_proj(h).view(1, MAX_TOKENS, -1, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(1, MAX_TOKENS, -1, attn.head_dim).transpose(1, 2)
        cos, sin = model.model.rotary_emb(h, torch.arange(MAX_TOKENS).unsqueeze(0))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
    cq, ck = llama_run.capture.layers[0].qk
    torch.testing.assert_close(cq, q[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ck, k[0], rtol=1e-4, atol=1e-5)


def test_plan_windows_scales_top_k_only_when_needed():
    kw = {"num_draft_tokens": 3, "block_size": 128, "num_sink": 1, "num_local": 1, "num_windows": 16}
    p = plan_windows(4096, top_k=16, min_context_len=2048, **kw)
    assert not p.top_k_scaled and p.min_context_len_applied and len(p.ctx_lens) == 16
    assert min(p.ctx_lens) >= 2048 and max(p.ctx_lens) == 4096 - 4
    assert all(math.ceil(c / 128) > 16 + 2 for c in p.ctx_lens)
    short = plan_windows(1500, top_k=16, min_context_len=2048, **kw)  # 12 context blocks
    assert short.top_k_scaled and short.top_k == (12 - 2) // 2 and not short.min_context_len_applied
    assert all(math.ceil(c / 128) > short.num_slots for c in short.ctx_lens)
    with pytest.raises(CalibrationError):
        plan_windows(300, top_k=16, min_context_len=0, **kw)


# ---- FFN -----------------------------------------------------------------------------------------


def test_ffn_group_shares_brute_force():
    g = torch.Generator().manual_seed(1)
    gate = torch.randn(13, 40, generator=g) * 2
    shares = ffn_group_keep_shares(gate, 4, 0.8)
    assert shares.shape == (3,)  # the 13th token makes no full group
    for grp in range(3):
        score = torch.nn.functional.silu(gate[grp * 4 : grp * 4 + 4]).abs().sum(0).tolist()
        total, acc, count = sum(score), 0.0, 0
        for v in sorted(score, reverse=True):
            acc += v
            count += 1
            if acc >= 0.8 * total:
                break
        assert shares[grp].item() == pytest.approx(count / 40)
    assert round_keep_ratio(0.001) == 1 / 64 and round_keep_ratio(1.0) == 1.0
    assert round_keep_ratio(0.5) == 0.5 and round_keep_ratio(0.501) == 33 / 64


def test_ffn_keep_ratios_grow_with_mass(llama, llama_run, text_file):
    low = calibrate(str(llama), _options(text_file, ffn_mass=0.5), write=False).profile.ffn_keep_ratios
    mid = llama_run.profile.ffn_keep_ratios  # mass 0.9
    high = calibrate(str(llama), _options(text_file, ffn_mass=0.99), write=False).profile.ffn_keep_ratios
    assert len(low) == len(mid) == len(high) > 0, f"keep ratios per layer: {len(low)}, {len(mid)}, {len(high)}"
    for lo, md, hi in zip(low, mid, high, strict=True):
        assert 0.0 < lo < md < hi <= 1.0
        assert (lo * 64) == int(lo * 64)  # on the 1/64 grid
    raw = llama_run.profile.details["ffn"]["median_share_unrounded"]
    assert len(raw) == len(mid), f"{len(raw)} unrounded shares for {len(mid)} layers"
    assert all(r <= v < r + 1 / 64 + 1e-9 for r, v in zip(raw, mid, strict=True))


# ---- MoE -----------------------------------------------------------------------------------------


def test_moe_thresholds_are_medians_of_router_ratios(mixtral, text_file):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = calibrate(str(mixtral), _options(text_file, max_tokens=512), write=False)
    profile = result.profile
    assert profile.ffn_keep_ratios is None  # every layer is MoE
    thresholds = profile.moe_ratio_thresholds
    assert len(thresholds) == profile.num_layers == 3
    assert profile.details["moe"]["top_k"] == 3

    # Independently: the model's own router-logit outputs, softmax, top-3, median of p_j / p_1.
    model = AutoModelForCausalLM.from_pretrained(str(mixtral), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(mixtral))
    ids = tok(Path(text_file).read_text(), return_tensors="pt")["input_ids"][:, :512]
    with torch.no_grad():
        logits = model(ids, output_router_logits=True).router_logits
    for layer, lg in enumerate(logits):
        ratios = []
        for row in torch.softmax(lg.float(), dim=-1).tolist():
            top = sorted(row, reverse=True)[:3]
            ratios += [top[1] / top[0], top[2] / top[0]]
        expected = statistics.median(ratios)
        assert 0.0 <= thresholds[layer] <= 1.0
        assert thresholds[layer] == pytest.approx(expected, rel=1e-5)
        # Using it as the prune ratio drops about half of the non-top-1 slots (its meaning).
        w = torch.empty(len(lg), 3)
        i = torch.empty(len(lg), 3, dtype=torch.int32)
        reference.moe_route_and_prune(lg, 3, thresholds[layer], None, 0, False, w, i)
        assert abs(float((i[:, 1:] < 0).float().mean()) - 0.5) < 0.02
