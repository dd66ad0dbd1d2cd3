"""Two-sample tests that sampled output follows the target's distribution."""

from __future__ import annotations

from collections import Counter

import torch


def chi2_two_sample_p(a: list[int], b: list[int]) -> float:
    """p-value of the chi-square test that `a` and `b` are draws from one categorical distribution
    (categories with fewer than 10 draws in all are pooled)."""
    ca, cb = Counter(a), Counter(b)
    pooled: dict = {}
    for key in set(ca) | set(cb):
        k = key if ca[key] + cb[key] >= 10 else "rare"
        pooled.setdefault(k, [0, 0])
        pooled[k][0] += ca[key]
        pooled[k][1] += cb[key]
    table = torch.tensor(list(pooled.values()), dtype=torch.float64)
    if table.shape[0] < 2:
        return 1.0
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    dof = table.shape[0] - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


def assert_follows_plain_sampling(sampled: list[list[int]], plain_samples: list[list[int]], label: str,
                                  samples: int, tokens: int) -> None:
    """Tokens 1..tokens-1 of the completions are distributed as plain sampling's (chi-square)."""
    assert len(sampled) == len(plain_samples) == samples
    assert all(len(s) == tokens for s in sampled)
    for position in range(1, tokens):
        p = chi2_two_sample_p([s[position] for s in sampled], [s[position] for s in plain_samples])
        assert p > 1e-3, f"token {position}: {label} samples differ from plain sampling (p={p:.2e})"
