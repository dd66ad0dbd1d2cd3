"""Self-drafting: the target's first L decoder layers plus a trained exit head propose the drafts,
inside the target worker (Kangaroo / LayerSkip style). No second model: the drafter *is* the
target's embedding, its layers 0..L-1 and its LM head, plus a small adapter (`ExitHead`).

Sharing the KV cache of layers 0..L-1. Drafting for a request whose last sampled token sits at
position P runs one token per iteration through layers 0..L-1 at positions P, P+1, ..., writing those
layers' K/V there and attending to the target's own K/V below. Every position it writes is one the
next verify step schedules (the sampled token and the drafts), and verification writes every
layer's K/V at its positions before reading them, so nothing the drafter wrote is ever read by the
target: the output is the target's, token for token (greedy), or distributed as the target's
(sampling: drafts are one-hot proposals that vLLM's rejection sampler accepts with probability
p_target(token) and otherwise resamples from the residual). The scheduler reserves the slots past
the verified tokens through the lookahead the plugin adds (`compat.vllm_config`).

Dynamic draft length: a request stops drafting at the first token whose head probability is below
`confidence` (that token is dropped), as Kangaroo does; 0 drafts then means a plain decode step.
Tensor parallel: every rank runs the same iterations; the logits are all-gathered (vLLM's logits
processor), so each rank takes the same argmax and the same stop decisions.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vllm_sparsever.step import DraftStep
from vllm_sparsever.metrics import counters_summary
from vllm_sparsever.config import SparseverConfig, SparseverConfigError
from vllm_sparsever.drafting.drafter import DraftRequests, RoundDrafter
from vllm_sparsever.drafting.early_exit_model import EarlyExitModel
from vllm_sparsever.drafting.exit_head import ExitHeadError, ExitHeadManifest, heads_dir
from vllm_sparsever.drafting.tree_drafter import TreeDrafting


def resolve_self_draft(config: SparseverConfig, model_config: Any) -> SparseverConfig:
    """Front end, before start-up: the config with `early_exit.heads` and the exit layers it uses
    made explicit (`.draft_layer` for self-drafting, `.verify_layer` for an early-exit intermediate
    verifier), after checking the heads exist and fit the target. SparseverConfigError otherwise."""
    ee = config.early_exit
    self_drafting = config.draft_source == "early_exit"
    folder = Path(ee.heads) if ee.heads else heads_dir(model_config.model)
    hf = model_config.hf_text_config
    architecture = ",".join(model_config.architectures or [])
    num_layers = int(hf.num_hidden_layers)
    try:
        manifest = ExitHeadManifest.load(folder)
        manifest.check_model(architecture, num_layers, int(hf.hidden_size), model_config.get_vocab_size())
        trained = sorted(e.exit_layer for e in manifest.heads)
        if not trained:
            raise ExitHeadError(f"{folder}: the manifest lists no heads")
        layer = None
        if self_drafting:
            layer = ee.draft_layer if ee.draft_layer is not None else trained[0]
            if not 1 <= layer < num_layers:
                raise ExitHeadError(f"early_exit.draft_layer: must be in 1..{num_layers - 1}, got {layer}")
        verify_layer = ee.verify_layer
        if ee.uses_heads:
            verify_layer = verify_layer if verify_layer is not None else trained[-1]
            lowest = layer or 0
            if not lowest < verify_layer < num_layers:
                raise ExitHeadError(
                    f"early_exit.verify_layer: must be deeper than draft_layer ({lowest}) and below "
                    f"the last layer ({num_layers}), got {verify_layer}; trained heads: {trained}"
                )
        if ee.draft_vocab is not None:
            from vllm_sparsever.drafting.draft_vocab import DRAFT_VOCAB_FILE, available_draft_vocab

            available = available_draft_vocab(folder)
            if available < ee.draft_vocab:
                raise ExitHeadError(
                    f"early_exit.draft_vocab: {ee.draft_vocab} tokens asked for, {folder / DRAFT_VOCAB_FILE} "
                    f"ranks {available} (allowed: 1..{available}; `vllm-sparsever train-exits` writes it)"
                )
        for needed in {layer, verify_layer} - {None}:
            entry = manifest.head_for(needed)
            if not (folder / entry.file).is_file():
                raise ExitHeadError(f"{folder / entry.file}: listed in the manifest but missing")
    except ExitHeadError as exc:
        raise SparseverConfigError(f"early_exit (exit heads): {exc}") from exc
    early_exit = dataclasses.replace(ee, heads=str(folder.resolve()), draft_layer=layer, verify_layer=verify_layer)
    return dataclasses.replace(config, early_exit=early_exit)


@dataclass
class SelfDraftStats:
    rounds: int = 0  # draft() calls (per step; with hierarchical verification, per round)
    forward_passes: int = 0  # layer-0..L-1 iterations
    draft_tokens: int = 0
    stopped_by_confidence: int = 0  # requests that stopped before k drafts on a low-confidence token
    # Requests whose drafts were cut short because their KV slots end (should stay 0: the scheduler
    # reserves lookahead slots for self-drafting; a count here means it did not).
    slot_limited: int = 0
    draft_time_s: float = 0.0
    confidence_sum: float = 0.0  # head probability of each drafted-or-stopped token, summed
    confidence_count: int = 0

    def summary(self) -> dict[str, Any]:
        return {**counters_summary(self, "self_draft_", {"draft_tokens": "self_draft_tokens",
                                                          "draft_time_s": "self_draft_time_s"},
                                   skip=("confidence_sum", "confidence_count")),
                "self_draft_mean_confidence": self.confidence_sum / max(self.confidence_count, 1)}


class SelfDraftProposer(TreeDrafting, RoundDrafter):
    level = "self_draft"

    def __init__(
        self,
        model: EarlyExitModel,
        *,
        exit_layer: int,
        num_speculative_tokens: int,
        confidence: float,
        max_model_len: int,
        tree: Any = None,
    ) -> None:
        """`tree`: a DraftTreeConfig to draft trees through layers 0..L-1 under the tree mask
        (EVICT-cut under drafting/evict_proposer.py); None: chains."""
        super().__init__(SelfDraftStats(), num_speculative_tokens=num_speculative_tokens, max_model_len=max_model_len)
        self.model = model
        self.exit_layer = exit_layer
        self.confidence = confidence
        self.init_trees(tree)

    def load(self, target: Any) -> None:
        self.model.load(target)
        super().load(target)

    def propose(self, step: DraftStep) -> list[list[int]]:
        """Draft tokens per batch row (a tree's nodes, parents first, with `tree`); a row that
        sampled nothing this step (mid-prefill, finished) gets none."""
        start = time.perf_counter()
        drafts = super().propose(step) if self.tree is None else self.propose_trees(step)
        self.stats.draft_time_s += time.perf_counter() - start
        if self.tree is not None:
            self.stats.draft_tokens += sum(len(d) for d in drafts)
        return drafts

    # ---- trees (TreeDrafting): layers 0..L-1 write their K/V at the nodes' slots -------------

    def _tree_root_top(self, reqs: DraftRequests, idx: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.model.device
        self.stats.rounds += 1
        self.stats.forward_passes += 1
        return self.model.top_tokens(
            self.exit_layer, torch.tensor([reqs.rows[i] for i in idx], dtype=torch.long),
            torch.tensor([reqs.tokens[i] for i in idx], dtype=torch.long, device=device),
            torch.tensor([reqs.positions[i] for i in idx], dtype=torch.long, device=device), [1] * len(idx), k)

    def _tree_level_top(self, rows, tokens, positions, kv_positions, lens, tree_mask, wanted, k, topologies):
        self.stats.forward_passes += 1
        return self.model.top_tokens(self.exit_layer, torch.tensor(rows, dtype=torch.long), tokens, positions, lens,
                                     k, wanted=wanted, kv_positions=kv_positions, tree_mask=tree_mask)

    @torch.inference_mode()
    def draft(self, reqs: DraftRequests, pending: list[list[int]] | None = None) -> list[list[int]]:
        """Up to min(num_speculative_tokens, budget) drafts per request of `reqs`, one token per
        request per iteration through layers 0..L-1 and the head. (`pending`, the tokens a
        hierarchy holds before `reqs.tokens`, is already in the KV cache: not needed here.)"""
        drafts: list[list[int]] = [[] for _ in reqs.rows]
        if not reqs.rows:
            return drafts
        device = self.model.device
        rows_t = torch.tensor(reqs.rows, dtype=torch.long)
        tokens_t = torch.tensor(reqs.tokens, dtype=torch.long, device=device)
        positions_t = torch.tensor(reqs.positions, dtype=torch.long, device=device)
        budgets = [min(b, self.num_speculative_tokens) for b in reqs.budgets]
        active = np.array([b > 0 for b in budgets], dtype=bool)
        self.stats.rounds += 1
        for _ in range(self.num_speculative_tokens):
            idx = np.flatnonzero(active)
            if idx.size == 0:
                break
            sel = torch.from_numpy(idx)
            sel_dev = sel.to(device)
            next_tokens, confidence = self.model.predict(
                self.exit_layer, rows_t[sel], tokens_t[sel_dev], positions_t[sel_dev], [1] * idx.size)
            self.stats.forward_passes += 1
            next_list = next_tokens.tolist()
            conf_list = confidence.tolist()
            self.stats.confidence_sum += sum(conf_list)
            self.stats.confidence_count += len(conf_list)
            for j, i in enumerate(idx):
                if conf_list[j] < self.confidence:
                    active[i] = False
                    self.stats.stopped_by_confidence += 1
                    continue
                drafts[i].append(next_list[j])
                if len(drafts[i]) >= budgets[i]:
                    active[i] = False
            tokens_t[sel_dev] = next_tokens
            positions_t[sel_dev] += 1
        self.stats.draft_tokens += sum(len(d) for d in drafts)
        return drafts
