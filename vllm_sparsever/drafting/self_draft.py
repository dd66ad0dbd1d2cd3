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

import time
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vllm_sparsever.config import SparseverConfig, SparseverConfigError
from vllm_sparsever.drafting.exit_head import ExitHead, ExitHeadError, ExitHeadManifest, heads_dir


def resolve_self_draft(config: SparseverConfig, model_config: Any) -> SparseverConfig:
    """Front end, before start-up: the config with `early_exit.heads` and `early_exit.draft_layer`
    made explicit, after checking the heads exist and fit the target. SparseverConfigError otherwise."""
    ee = config.early_exit
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
        layer = ee.draft_layer if ee.draft_layer is not None else trained[0]
        if not 1 <= layer < num_layers:
            raise ExitHeadError(f"early_exit.draft_layer: must be in 1..{num_layers - 1}, got {layer}")
        entry = manifest.head_for(layer)
        if not (folder / entry.file).is_file():
            raise ExitHeadError(f"{folder / entry.file}: listed in the manifest but missing")
    except ExitHeadError as exc:
        raise SparseverConfigError(f"early_exit (draft_source='early_exit'): {exc}") from exc
    early_exit = dataclasses.replace(ee, heads=str(folder.resolve()), draft_layer=layer)
    return dataclasses.replace(config, early_exit=early_exit)


@dataclass
class SelfDraftStats:
    rounds: int = 0  # propose() calls that drafted for at least one request
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
        return {
            "self_draft_rounds": self.rounds,
            "self_draft_forward_passes": self.forward_passes,
            "self_draft_tokens": self.draft_tokens,
            "self_draft_stopped_by_confidence": self.stopped_by_confidence,
            "self_draft_slot_limited": self.slot_limited,
            "self_draft_time_s": self.draft_time_s,
            "self_draft_mean_confidence": self.confidence_sum / max(self.confidence_count, 1),
        }


class SelfDraftProposer:
    def __init__(
        self,
        *,
        exit_layer: int,
        num_speculative_tokens: int,
        confidence: float,
        heads_dir: str | Path,
        max_model_len: int,
    ) -> None:
        self.exit_layer = exit_layer
        self.num_speculative_tokens = num_speculative_tokens
        self.confidence = confidence
        self.heads_dir = Path(heads_dir)
        self.max_model_len = max_model_len
        self.stats = SelfDraftStats()
        self._stack = None
        self._head: ExitHead | None = None
        self._layer_names: list[str] = []
        self._runner: Any = None

    # ---- set-up -------------------------------------------------------------------------

    def load(self, runner: Any) -> None:
        """Bind to the runner's loaded target: its decoder stack and the trained head for
        `exit_layer` (ExitHeadError if the heads do not fit this model)."""
        from vllm_sparsever.integration.compat.model import decoder_stack

        model = runner.model
        architecture = ",".join(runner.model_config.architectures or [])
        vocab_size = runner.model_config.get_vocab_size()
        stack = decoder_stack(model)
        manifest = ExitHeadManifest.load(self.heads_dir)
        manifest.check_model(architecture, len(stack.layers), stack.hidden_size, vocab_size)
        entry = manifest.head_for(self.exit_layer)
        param = next(model.parameters())
        head = ExitHead.load(self.heads_dir / entry.file, eps=stack.rms_norm_eps, dtype=param.dtype)
        self._head = head.to(param.device)
        self._stack = stack
        self._layer_names = stack.attention_layer_names[: self.exit_layer]
        self._runner = runner

    # ---- drafting -----------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, sampled_token_ids: list[list[int]]) -> list[list[int]]:
        """Draft tokens per batch row (row order of `sampled_token_ids`, as vLLM's n-gram drafter
        returns them); a row that sampled nothing this step (mid-prefill, finished) gets none."""
        from vllm_sparsever.integration.compat.runner import allocated_slots, tokens_no_spec

        assert self._stack is not None, "SelfDraftProposer.load() was not called"
        start = time.perf_counter()
        num_tokens = tokens_no_spec(self._runner)
        # Iteration j writes K/V at position + j: never past the request's allocated slots (the
        # scheduler's lookahead covers num_speculative_tokens; this guards the rest).
        allocated = allocated_slots(self._runner)
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        rows, tokens, positions, budgets = [], [], [], []
        for row, sampled in enumerate(sampled_token_ids):
            if not sampled:
                continue
            position = int(num_tokens[row]) - 1  # where the token sampled this step sits
            budget = min(self.num_speculative_tokens, self.max_model_len - position - 1)
            if int(allocated[row]) - position < budget:
                budget = int(allocated[row]) - position
                self.stats.slot_limited += 1
            if budget <= 0:
                continue
            rows.append(row)
            tokens.append(sampled[-1])
            positions.append(position)
            budgets.append(budget)
        if not rows:
            return drafts
        device = self._head.norm_out.device
        rows_t = torch.tensor(rows, dtype=torch.long)
        tokens_t = torch.tensor(tokens, dtype=torch.long, device=device)
        positions_t = torch.tensor(positions, dtype=torch.long, device=device)
        budgets_np = np.asarray(budgets)
        active = np.ones(len(rows), dtype=bool)
        self.stats.rounds += 1
        for _ in range(self.num_speculative_tokens):
            idx = np.flatnonzero(active)
            if idx.size == 0:
                break
            sel = torch.from_numpy(idx)
            next_tokens, confidence = self._step(rows_t[sel], tokens_t[sel.to(device)], positions_t[sel.to(device)])
            next_list = next_tokens.tolist()
            conf_list = confidence.tolist()
            self.stats.confidence_sum += sum(conf_list)
            self.stats.confidence_count += len(conf_list)
            for j, i in enumerate(idx):
                if conf_list[j] < self.confidence:
                    active[i] = False
                    self.stats.stopped_by_confidence += 1
                    continue
                drafts[rows[i]].append(next_list[j])
                if len(drafts[rows[i]]) >= budgets_np[i]:
                    active[i] = False
            tokens_t[sel.to(device)] = next_tokens
            positions_t[sel.to(device)] += 1
        n = sum(len(d) for d in drafts)
        self.stats.draft_tokens += n
        self.stats.draft_time_s += time.perf_counter() - start
        return drafts

    def _step(self, rows: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor):
        """One token per request through layers 0..L-1 and the head: (argmax token, its prob)."""
        from vllm.forward_context import set_forward_context

        from vllm_sparsever.integration.compat.runner import decode_attention_context

        runner = self._runner
        metadata, slots = decode_attention_context(runner, self._layer_names, rows, positions)
        with set_forward_context(metadata, runner.vllm_config, num_tokens=int(rows.numel()), slot_mapping=slots):
            stream = self._stack.run_layers(self.exit_layer, tokens, positions)
        logits = self._stack.compute_logits(self._head(stream)).float()
        probs = torch.softmax(logits, dim=-1)
        confidence, next_tokens = probs.max(dim=-1)
        self.stats.forward_passes += 1
        return next_tokens, confidence
