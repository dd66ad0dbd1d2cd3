"""EAGLE-3's training-time test, trained and evaluated: the head runs `ttt_steps` steps as it will
in vLLM; step k is trained towards the target's distribution at s+k (KL over the draft vocabulary,
later steps weighing less), on the shared loop (training.py); evaluation reports per step the top-1
agreement with the target and the mean agreeing prefix of a chain."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm_sparsever.offline.eagle3.features import Sequence
from vllm_sparsever.offline.eagle3.head import Eagle3Head
from vllm_sparsever.offline.eagle3.options import TrainEagleOptions
from vllm_sparsever.offline.training import train_loop

# Later steps weigh less: a chain stops at its first rejected draft.
STEP_WEIGHT_DECAY = 0.8


def _step_targets(seq: Sequence, k: int) -> torch.Tensor:
    """Base positions s whose step-k prediction is trained and evaluated: s + k is a position
    whose next token was generated (p = s + k in [first, T-1])."""
    t = seq.tokens.shape[0]
    return torch.arange(max(0, seq.first - k), t - k)


def _teacher_logp(seq: Sequence, positions: torch.Tensor, draft_lm_head: torch.Tensor) -> torch.Tensor:
    return F.log_softmax(seq.final[positions].float() @ draft_lm_head.T, dim=-1)


def train_head(head: Eagle3Head, embed: nn.Module, train: list[Sequence], options: TrainEagleOptions,
               deadline: float) -> tuple[int, int, bool, list[float]]:
    """(steps done, steps planned, stopped by the time budget, mean loss per epoch). One sequence
    per step."""
    params = [p for p in head.parameters() if p.requires_grad]
    weights = [STEP_WEIGHT_DECAY ** k for k in range(options.ttt_steps)]

    def batches(generator: torch.Generator) -> list[Sequence]:
        return [train[i] for i in torch.randperm(len(train), generator=generator).tolist()]

    def step(seq: Sequence) -> tuple[float, int]:
        logits = head.chain(embed, seq.tokens, seq.aux.float(), options.ttt_steps)
        # Every step's targets are positions first..T-1 (step k's bases shifted by k): one teacher.
        teacher_all = _teacher_logp(seq, torch.arange(seq.first, seq.tokens.shape[0]), head.lm_head)
        loss = torch.zeros(())
        for k, step_logits in enumerate(logits, start=1):
            bases = _step_targets(seq, k)
            if len(bases) == 0:
                continue
            teacher = teacher_all[bases + k - seq.first]
            student = F.log_softmax(step_logits[bases], dim=-1)
            loss = loss + weights[k - 1] * (teacher.exp() * (teacher - student)).sum(-1).mean()
        loss.backward()
        return float(loss.detach()), 1

    head.train()
    run = train_loop(params, batches, step, steps_per_epoch=len(train), epochs=options.epochs, lr=options.lr,
                     weight_decay=options.weight_decay, seed=options.seed, deadline=deadline,
                     show_progress=options.show_progress, clip_grad_norm=1.0)
    head.eval()
    return run


@torch.no_grad()
def evaluate(head: Eagle3Head, embed: nn.Module, seqs: list[Sequence], steps: int,
             draft_ids: torch.Tensor) -> dict[str, Any]:
    """Per step the top-1 agreement with the target (full vocabulary), and the mean agreeing
    prefix of a `steps`-draft chain per base position (teacher-forced)."""
    agree = [0] * steps
    seen = [0] * steps
    prefix_sum, bases_seen = 0, 0
    for seq in seqs:
        logits = head.chain(embed, seq.tokens, seq.aux.float(), steps)
        hits = []
        for k, step_logits in enumerate(logits, start=1):
            drafted = draft_ids[step_logits.argmax(-1)]
            positions = torch.arange(step_logits.shape[0]) + k
            ok = drafted == seq.target_argmax[positions.clamp(max=seq.tokens.shape[0] - 1)]
            bases = _step_targets(seq, k)
            agree[k - 1] += int(ok[bases].sum())
            seen[k - 1] += len(bases)
            hits.append(ok)
        # Chains whose every step has a target: bases whose last step's position exists.
        full = _step_targets(seq, steps)
        if len(full):
            run = torch.ones(len(full), dtype=torch.long)
            length = torch.zeros(len(full), dtype=torch.long)
            for ok in hits:
                run = run * ok[full].long()
                length += run
            prefix_sum += int(length.sum())
            bases_seen += len(full)
    return {"agreement_per_step": [round(a / max(1, n), 4) for a, n in zip(agree, seen)],
            "mean_accepted_prefix": round(prefix_sum / max(1, bases_seen), 4), "positions": seen[0]}


def draft_vocabulary(texts: list[list[int]], vocab: int, size: int | None, always: list[int]) -> torch.Tensor:
    """The draft vocabulary, in id order: the `size` most frequent tokens of `texts` (`always`
    first; then the lowest unused ids if the texts have fewer), or the whole vocabulary."""
    from vllm_sparsever.drafting.draft_vocab import rank_tokens

    if size is None or size >= vocab:
        return torch.arange(vocab)
    ranked = rank_tokens(texts, always=always)
    extra = torch.tensor([t for t in range(vocab) if t not in set(ranked.tolist())], dtype=torch.long)
    return torch.cat([ranked, extra])[:size].sort().values
