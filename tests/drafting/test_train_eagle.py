"""`vllm-sparsever train-eagle` on a tiny random Llama (HF transformers, CPU, no vLLM engine; seconds).

The tiny model's next-token distributions are peaked (`make_tiny_exit_llama`), so the head has
something to learn. That stock vLLM loads the head and drafts with it is tested end to end in
tests/e2e/test_vllm_drafters.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_exit_llama, train_tiny_eagle3

from vllm_sparsever.offline.eagle3.head import ARCHITECTURE
from vllm_sparsever.offline.eagle3.options import TrainEagleError, TrainEagleOptions
from vllm_sparsever.offline.eagle3.text import text_rows
from vllm_sparsever.offline.train_eagle import MANIFEST_NAME, default_aux_layers, train_eagle

NUM_LAYERS = 6
DRAFT_VOCAB = 200


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("train_eagle")


@pytest.fixture(scope="module")
def model_dir(workdir) -> Path:
    return make_tiny_exit_llama(workdir / "llama", num_layers=NUM_LAYERS)


@pytest.fixture(scope="module")
def head(workdir, model_dir) -> Path:
    return train_tiny_eagle3(workdir / "head", model_dir, draft_vocab=DRAFT_VOCAB)


def test_head_is_written_in_vllms_eagle3_format(head, model_dir):
    from safetensors.torch import load_file

    config = json.loads((head / "config.json").read_text())
    target = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE]
    assert config["num_hidden_layers"] == 1 and config["vocab_size"] == target["vocab_size"]
    assert config["draft_vocab_size"] == DRAFT_VOCAB
    assert config["eagle_aux_hidden_state_layer_ids"] == list(default_aux_layers(NUM_LAYERS))
    # The head's rotary embedding is the target's (vLLM builds it from the head's config).
    rope = {k: target[k] for k in ("rope_theta", "rope_scaling", "rope_parameters") if target.get(k) is not None}
    assert rope and all(config[k] == v for k, v in rope.items()), (rope, config)
    weights = load_file(str(head / "model.safetensors"))
    hidden = target["hidden_size"]
    assert weights["fc.weight"].shape == (hidden, 3 * hidden)
    assert weights["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * hidden
    assert weights["lm_head.weight"].shape == (DRAFT_VOCAB, hidden)
    assert "embed_tokens.weight" not in weights  # vLLM shares the target's
    # The trimmed vocabulary: draft id i is target id i + d2t[i]; t2d marks the kept target ids.
    target_ids = torch.arange(DRAFT_VOCAB) + weights["d2t"]
    assert torch.equal(weights["t2d"].nonzero().flatten(), target_ids)
    assert int(target["eos_token_id"]) in target_ids.tolist()
    # The LM head rows are the target's rows of those tokens (frozen while training).
    target_weights = load_file(str(model_dir / "model.safetensors"))
    assert torch.allclose(weights["lm_head.weight"], target_weights["lm_head.weight"][target_ids])


def test_training_raises_held_out_agreement(head):
    record = json.loads((head / MANIFEST_NAME).read_text())
    before, after = record["heldout"]["untrained"], record["heldout"]["trained"]
    assert len(after["agreement_per_step"]) == 3
    assert after["agreement_per_step"][0] > before["agreement_per_step"][0] + 0.05, record["heldout"]
    assert after["mean_accepted_prefix"] > before["mean_accepted_prefix"]
    assert record["steps"] == record["planned_steps"] > 0
    assert record["train_loss_per_epoch"][-1] < record["train_loss_per_epoch"][0]


def test_default_aux_layers_end_at_the_last_layer_where_they_are_distinct():
    assert default_aux_layers(28) == (2, 14, 28)
    assert default_aux_layers(2) == (0, 1, 2)
    assert len(set(default_aux_layers(4))) == 3


@pytest.mark.parametrize("options, words", [
    ({"aux_layers": (3, 1)}, ["--aux-layers", "increasing"]),
    ({"aux_layers": (0, 9)}, ["--aux-layers", "0..6"]),
    ({"ttt_steps": 0}, ["--ttt-steps", "at least 1"]),
    ({"draft_vocab": 0}, ["--draft-vocab", "at least 1"]),
    ({"lr": 0.0}, ["--lr"]),
])
def test_bad_options_are_named_before_any_work(model_dir, options, words):
    with pytest.raises(TrainEagleError) as err:
        train_eagle(str(model_dir), TrainEagleOptions(**options, prompt_rows=[{"id": "a", "prompt": "w1"}]))
    for word in words:
        assert word in str(err.value)


def test_python_source_chunks_hold_out_other_files_and_stop_at_their_counts():
    from vllm_sparsever.data.python_source import EXCLUDED_DIRS, python_source_chunks, stdlib_root

    class Chars:  # a character-level tokenizer: chunk sizes are exact and cheap
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) % 1000 for c in text]}

    train, heldout = python_source_chunks(Chars(), train_tokens=3000, heldout_tokens=1000, chunk_tokens=256, seed=1)
    for part, want in ((train, 3000), (heldout, 1000)):
        total = sum(len(c["token_ids"]) for c in part)
        assert want <= total < want + 256, (want, total)
        assert all(64 <= len(c["token_ids"]) <= 256 for c in part)
    assert not {c["id"] for c in train} & {c["id"] for c in heldout}
    assert all(not EXCLUDED_DIRS.intersection(c["id"].split("/")[:-1]) for c in train + heldout)
    # A chunk is the file's text from a line start.
    first = heldout[0]
    text = (stdlib_root() / first["id"]).read_text(encoding="utf-8")
    chunk = "".join(chr(i) for i in first["token_ids"]) if all(i < 128 for i in first["token_ids"]) else None
    if chunk is not None:
        at = text.find(chunk)
        assert at == 0 or text[at - 1] == "\n"
    # Seeded: the same chunks again, other chunks under another seed.
    assert python_source_chunks(Chars(), 3000, 1000, 256, seed=1) == (train, heldout)
    assert python_source_chunks(Chars(), 3000, 1000, 256, seed=2)[0] != train


def test_code_text_and_all_positions_are_trained_and_reported(workdir, model_dir):
    head = train_tiny_eagle3(workdir / "head_code", model_dir, draft_vocab=DRAFT_VOCAB, epochs=2,
                             train_positions="all", code_tokens=600, code_heldout_tokens=200)
    record = json.loads((head / MANIFEST_NAME).read_text())
    code = record["data"]["code"]
    assert code["train_files"] and code["heldout_files"] and not set(code["train_files"]) & set(code["heldout_files"])
    # Every position of the code and of the generated sequences (prompts included) is trained.
    assert record["train_tokens"] - record["data"]["train_tokens_generated_text"] >= 600 - len(code["train_files"])
    assert "prompts teacher-forced" in record["data"]["positions"]
    assert set(record["heldout_code"]) == {"untrained", "trained"}
    assert record["heldout_code"]["trained"]["positions"] >= 200 - 3 * len(code["heldout_files"])


@pytest.mark.parametrize("options, words", [
    ({"train_positions": "prompt"}, ["--train-positions", "generated, all"]),
    ({"code_tokens": -1}, ["--code-tokens", "at least 0"]),
    ({"feature_scale": "std"}, ["--feature-scale", "rms, none"]),
    ({"text": "books"}, ["--text", "calibration, chat"]),
])
def test_bad_text_options_are_named(model_dir, options, words):
    with pytest.raises(TrainEagleError) as err:
        train_eagle(str(model_dir), TrainEagleOptions(**options, prompt_rows=[{"id": "a", "prompt": "w1"}]))
    for word in words:
        assert word in str(err.value)


def test_a_head_trained_on_scaled_streams_saves_the_scale_into_fc(model_dir):
    """Trained on streams / RMS, saved to read the raw streams: the loaded head (no scale) drafts
    the same logits as the training head."""
    from vllm_sparsever.offline.eagle3.head import Eagle3Head, load_head, rotary_embedding

    config = json.loads((model_dir / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads, head_dim = config["num_key_value_heads"], config.get("head_dim") or hidden // heads
    torch.manual_seed(3)
    head = Eagle3Head(hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim, intermediate=48, num_aux=3,
                      eps=1e-6, rotary=rotary_embedding(config, head_dim), lm_head=torch.randn(DRAFT_VOCAB, hidden))
    head.aux_inv_scale.copy_(torch.rand(3 * hidden) * 10 + 0.01)
    embed = torch.nn.Embedding(config["vocab_size"], hidden)
    tokens, aux = torch.randint(0, config["vocab_size"], (9,)), torch.randn(9, 3 * hidden)
    want = head.chain(embed, tokens, aux, 2)
    from safetensors.torch import save_file

    out = model_dir.parent / "scaled_head"
    out.mkdir(exist_ok=True)
    save_file(head.state_for_vllm(), str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({
        "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "intermediate_size": 48, "rms_norm_eps": 1e-6, "draft_vocab_size": DRAFT_VOCAB,
        "eagle_aux_hidden_state_layer_ids": [1, 3, 5]}))
    loaded, _, _ = load_head(out, config)
    assert torch.equal(loaded.aux_inv_scale, torch.ones(3 * hidden))
    got = loaded.chain(embed, tokens, aux, 2)
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_features_are_cached_per_text_and_grow_by_layers(tmp_path, model_dir):
    from vllm_sparsever.offline.common import load_target
    from vllm_sparsever.offline.eagle3.features import FEATURES_DIRNAME, cached_features, extract_features

    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    model, _ = load_target(str(model_dir))
    seqs = [{"id": "a", "prompt_ids": [1, 2, 3], "generated_ids": [4, 5, 6, 7]}]
    first = cached_features(tmp_path, model, seqs, (1, 3, 5), "", False)
    files = lambda: sorted((tmp_path / FEATURES_DIRNAME).glob("*.pt"))  # noqa: E731
    assert len(files()) == 1

    class NoModel:  # a hit must not run the target
        def __getattr__(self, name):
            raise AssertionError("the target ran on a cache hit")

    def same(a, b):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert x.first == y.first
            for name in ("tokens", "aux", "final", "target_argmax"):
                assert torch.equal(getattr(x, name), getattr(y, name)), name

    same(cached_features(tmp_path, NoModel(), seqs, (1, 3, 5), "", False), first)
    # Every position, from the same entry.
    assert cached_features(tmp_path, NoModel(), seqs, (1, 3, 5), "", False, all_positions=True)[0].first == 0
    # Other layers: computed once and added to the same file; any subset is then a hit, in its order.
    cached_features(tmp_path, model, seqs, (0, 2, 6), "", False)
    assert len(files()) == 1
    same(cached_features(tmp_path, NoModel(), seqs, (1, 3, 5), "", False), first)
    same(cached_features(tmp_path, NoModel(), seqs, (2, 5, 6), "", False),
         extract_features(model, seqs, (2, 5, 6), "", False))
    # Other tokens: another file.
    other = cached_features(tmp_path, model, [{**seqs[0], "generated_ids": [4, 5, 6, 8]}], (1, 3, 5), "", False)
    assert other[0].tokens[-1] == 8 and len(files()) == 2


def test_chat_text_leaves_out_the_benchmarks_prompts_and_spans_every_category(monkeypatch):
    import vllm_sparsever.data as data
    from vllm_sparsever.offline.eagle3.text import CHAT_CATEGORIES, EVALUATION_PROMPTS

    sizes = dict(zip(CHAT_CATEGORIES, (30, 200, 40)))
    # As the data builders write them: every row has its `prompt` (mt_bench's first turn).
    rows = {c: [{"id": str(i), "prompt": f"{c} {i}", **({"turns": [f"{c} {i}", "2nd"]} if c == "mt_bench" else {})}
                for i in range(n)] for c, n in sizes.items()}
    monkeypatch.setattr(data, "load_prompts", lambda category, n=None, root=None: rows[category][:n])

    train, heldout = text_rows(TrainEagleOptions(text="chat", num_heldout_prompts=5, num_prompts=30,
                                                 samples_per_prompt=1))
    assert len(train) == 30 and len(heldout) == 5
    index = lambda r: int(r["id"].split(":")[1])  # noqa: E731
    # The benchmarks take each category's first prompts: never trained on or held out.
    assert min(index(r) for r in train + heldout) >= EVALUATION_PROMPTS
    assert not {r["id"] for r in train} & {r["id"] for r in heldout}
    # Interleaved: --num-prompts and the held-out prompts take from every category.
    for part in (train, heldout):
        assert {r["id"].split(":")[0] for r in part} == set(CHAT_CATEGORIES)
    # Each row keeps its data set's prompt.
    assert all(r["prompt"] == f"{r['id'].split(':')[0]} {index(r)}" for r in train + heldout)


def test_chat_text_has_its_own_defaults_and_flags_override_them():
    from vllm_sparsever.offline.eagle3.options import CHAT_DEFAULTS

    chat = TrainEagleOptions.for_text("chat")
    assert all(getattr(chat, k) == v for k, v in CHAT_DEFAULTS.items()) and chat.text == "chat"
    assert TrainEagleOptions.for_text("chat", epochs=7).epochs == 7
    assert TrainEagleOptions.for_text("calibration") == TrainEagleOptions()
