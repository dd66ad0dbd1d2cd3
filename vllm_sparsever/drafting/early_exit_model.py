"""The target's early exits inside the worker: its first L decoder layers plus the head trained at
layer L, run outside vLLM's step on the target's own weights and KV cache.

Used by the self-drafter (one token per request per call) and by the intermediate verifier of
hierarchical verification (a round of drafts per request). Every call writes layers 0..L-1's K/V
at the positions it runs; the caller only runs positions the next full verification rewrites.
Logits come through the target's logits processor, all-gathered across tensor-parallel ranks, so
every rank takes the same decisions from them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from vllm_sparsever.drafting.exit_head import ExitHead, ExitHeadManifest


class EarlyExitModel:
    def __init__(self, heads_dir: str | Path, layers: tuple[int, ...],
                 trimmed_vocab: dict[int, int] | None = None) -> None:
        self.heads_dir = Path(heads_dir)
        self.layers = layers
        # exit layer -> size of its trimmed draft vocabulary (VocabTrim); other layers: full vocab.
        self.trimmed_vocab = dict(trimmed_vocab or {})
        self.heads: dict[int, ExitHead] = {}
        self._trimmed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (ids, LM head rows)
        self._stack = None
        self._target: Any = None  # step.TargetView

    def load(self, target: Any) -> None:
        """Bind to the loaded target (a step.TargetView) and load the heads of `layers`
        (ExitHeadError if the heads do not fit this model). Once per target: the drafter and the
        verifier share it."""
        from vllm_sparsever.compat.model import decoder_stack

        if self._target is target:
            return
        model = target.model
        stack = decoder_stack(model)
        manifest = ExitHeadManifest.load(self.heads_dir)
        manifest.check_model(
            ",".join(target.model_config.architectures or []), len(stack.layers), stack.hidden_size,
            target.model_config.get_vocab_size(),
        )
        param = next(model.parameters())
        for layer in self.layers:
            entry = manifest.head_for(layer)
            head = ExitHead.load(self.heads_dir / entry.file, eps=stack.rms_norm_eps, dtype=param.dtype)
            self.heads[layer] = head.to(param.device)
        self._stack = stack
        self._target = target
        if self.trimmed_vocab:
            from vllm_sparsever.drafting.draft_vocab import load_draft_vocab
            from vllm_sparsever.compat.model import lm_head_rows

            for layer, size in self.trimmed_vocab.items():
                ids = load_draft_vocab(self.heads_dir, size).to(param.device)
                self._trimmed[layer] = (ids, lm_head_rows(model, ids))

    @property
    def device(self) -> torch.device:
        return next(iter(self.heads.values())).norm_out.device

    @torch.inference_mode()
    def predict(
        self, exit_layer: int, rows: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
        query_lens: list[int], *, with_stream: bool = False,
    ) -> tuple[torch.Tensor, ...]:
        """(argmax token, its probability) of the head at `exit_layer` per query token; over the
        layer's trimmed draft vocabulary if it has one (the LM head rows of those tokens only).
        `with_stream`: also the residual stream after layer `exit_layer` (what the full target's
        layer `exit_layer` takes as input for these tokens)."""
        stream = self.stream(exit_layer, rows, tokens, positions, query_lens)
        normed = self.heads[exit_layer](stream)
        trimmed = self._trimmed.get(exit_layer)
        if trimmed is None:
            logits = self._stack.compute_logits(normed).float()
            confidence, token = torch.softmax(logits, dim=-1).max(dim=-1)
        else:
            ids, weight = trimmed
            logits = torch.nn.functional.linear(normed, weight).float()
            confidence, index = torch.softmax(logits, dim=-1).max(dim=-1)
            token = ids[index]
        return (token, confidence, stream) if with_stream else (token, confidence)

    @torch.inference_mode()
    def top_tokens(
        self, exit_layer: int, rows: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
        query_lens: list[int], k: int, *, wanted: torch.Tensor | None = None,
        kv_positions: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's top-k (probabilities, token ids) after the query tokens `wanted` (default:
        all), over the layer's trimmed draft vocabulary if it has one. Tree queries give their
        K/V slots' positions and ancestor mask (draft trees, drafting/tree_drafter.py)."""
        stream = self.stream(exit_layer, rows, tokens, positions, query_lens, kv_positions=kv_positions,
                             tree_mask=tree_mask)
        normed = self.heads[exit_layer](stream if wanted is None else stream[wanted])
        trimmed = self._trimmed.get(exit_layer)
        if trimmed is None:
            return torch.softmax(self._stack.compute_logits(normed).float(), dim=-1).topk(k, dim=-1)
        ids, weight = trimmed
        top_p, index = torch.softmax(torch.nn.functional.linear(normed, weight).float(), dim=-1).topk(k, dim=-1)
        return top_p, ids[index]

    @torch.inference_mode()
    def stream(
        self, exit_layer: int, rows: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
        query_lens: list[int], *, kv_positions: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The residual stream after the first `exit_layer` layers for `query_lens[i]` consecutive
        tokens of batch row `rows[i]` (tokens/positions flattened request after request), writing
        those layers' K/V at the tokens' positions (or at `kv_positions`, under `tree_mask`)."""
        from vllm_sparsever.drafting.queries import run_query

        assert self._stack is not None, "EarlyExitModel.load() was not called"
        return run_query(self._target, self._stack, rows, tokens, positions, query_lens, num_layers=exit_layer,
                         kv_positions=kv_positions, tree_mask=tree_mask)
