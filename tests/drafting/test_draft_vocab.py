"""VocabTrim: token ranking from the target's generated text, and the LM head rows it reads."""

import json

import pytest
import torch
from types import SimpleNamespace

from vllm_sparsever.drafting.draft_vocab import (
    available_draft_vocab,
    build_draft_vocab,
    load_draft_vocab,
    rank_tokens,
)


def test_rank_tokens_by_frequency_with_forced_tokens_first():
    ranked = rank_tokens([[5, 7, 7, 9], [7, 5, 2]], always=(2, 11))
    assert ranked.tolist() == [2, 11, 7, 5, 9]  # 7 x3, 5 x2, then 9 (ties by id)


def test_build_and_load_from_generated_text(tmp_path):
    lines = [{"key": "x"}, {"id": "a", "prompt_ids": [1, 1, 1], "generated_ids": [4, 4, 3]},
             {"id": "b", "prompt_ids": [1], "generated_ids": [3, 4, 8]}]
    (tmp_path / "generated.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    build_draft_vocab(tmp_path, always=(2,))
    assert available_draft_vocab(tmp_path) == 4  # prompt tokens are not counted
    assert load_draft_vocab(tmp_path, 3).tolist() == [2, 4, 3]
    with pytest.raises(ValueError, match="4 ranked tokens, 5 asked"):
        load_draft_vocab(tmp_path, 5)
    assert available_draft_vocab(tmp_path / "nowhere") == 0
    # With a manifest, only the training sequences are ranked (held-out text stays out).
    (tmp_path / "manifest.json").write_text(json.dumps({"training": {"data": {"train_ids": ["b"]}}}))
    build_draft_vocab(tmp_path)
    assert load_draft_vocab(tmp_path, 3).tolist() == [3, 4, 8]


def test_lm_head_rows_single_rank(vllm_env):
    from vllm_sparsever.integration.compat.model import lm_head_rows

    weight = torch.randn(10, 4)
    model = SimpleNamespace(lm_head=SimpleNamespace(weight=weight))
    ids = torch.tensor([7, 2, 9])
    rows = lm_head_rows(model, ids)
    assert torch.equal(rows, weight[ids])
    # Logits over the trimmed rows equal the full logits at those ids.
    h = torch.randn(3, 4)
    assert torch.allclose(h @ rows.T, (h @ weight.T)[:, ids])
