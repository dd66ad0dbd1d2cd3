"""VocabTrim: token ranking from the target's generated text, and the LM head rows it reads."""

import pytest
import torch
from types import SimpleNamespace

from vllm_sparsever.drafting.draft_vocab import (
    available_draft_vocab,
    load_draft_vocab,
    rank_tokens,
    save_draft_vocab,
)


def test_rank_tokens_by_frequency_with_forced_tokens_first():
    ranked = rank_tokens([[5, 7, 7, 9], [7, 5, 2]], always=(2, 11))
    assert ranked.tolist() == [2, 11, 7, 5, 9]  # 7 x3, 5 x2, then 9 (ties by id)


def test_save_and_load(tmp_path):
    save_draft_vocab(tmp_path, rank_tokens([[4, 4, 3], [3, 4, 8]], always=(2,)))
    assert available_draft_vocab(tmp_path) == 4
    assert load_draft_vocab(tmp_path, 3).tolist() == [2, 4, 3]
    with pytest.raises(ValueError, match="4 ranked tokens, 5 asked"):
        load_draft_vocab(tmp_path, 5)
    assert available_draft_vocab(tmp_path / "nowhere") == 0


def test_lm_head_rows_single_rank(vllm_env):
    from vllm_sparsever.compat.model import lm_head_rows

    weight = torch.randn(10, 4)
    model = SimpleNamespace(lm_head=SimpleNamespace(weight=weight))
    ids = torch.tensor([7, 2, 9])
    rows = lm_head_rows(model, ids)
    assert torch.equal(rows, weight[ids])
    # Logits over the trimmed rows equal the full logits at those ids.
    h = torch.randn(3, 4)
    assert torch.allclose(h @ rows.T, (h @ weight.T)[:, ids])
