"""The intermediate level of hierarchical verification: what checks each round of drafts before the
full target does (`early_exit.intermediate`).

- `EarlyExitVerifier` ("early_exit"): the target's first `verify_layer` layers plus the exit head
  trained there (HiSpec). Cheap in layers, as good as the head.
- `SparseTargetVerifier` ("sparse"): the whole target with the sparse-verification sections in
  force (block-sparse attention, top-k FFN, MoE pruning; the sections enabled in the config), run
  under its own `VerificationPlan` at level INTERMEDIATE. The full level (vLLM's verify step) is
  then planned dense, so sparse verification becomes lossless: what the sparse target gets wrong,
  the dense pass rejects and corrects.

Both predict, for `seqs[i]` = [last pending token, drafts...] of batch row `rows[i]` at positions
`first_positions[i]`..., the verifier's greedy next token after every position. They write the K/V
of the layers they run at those positions; every such position is rewritten by the next full
verification before it is read (the hierarchy reserves the slots). Logits are all-gathered across
tensor-parallel ranks (vLLM's logits processor), so every rank takes the same argmax.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllm_sparsever.drafting.early_exit_model import EarlyExitModel
from vllm_sparsever.drafting.queries import final_hidden, flatten_queries, split_by_lengths


class EarlyExitVerifier:
    name = "early_exit"

    def __init__(self, model: EarlyExitModel, layer: int) -> None:
        self.model = model
        self.layer = layer

    def load(self, target: Any) -> None:
        self.model.load(target)  # once per target, shared with the self-drafter

    @torch.inference_mode()
    def predict(self, rows: list[int], seqs: list[list[int]], first_positions: list[int],
                with_streams: bool = False) -> Any:
        """Predictions per request; `with_streams`: (predictions, per request the residual stream
        after layer `layer` of its tokens, [len(seq), hidden]) for the full pass to start from."""
        tokens, positions, lens = flatten_queries(seqs, first_positions, self.model.device)
        predicted, _, stream = self.model.predict(self.layer, torch.tensor(rows, dtype=torch.long), tokens,
                                                  positions, lens, with_stream=True)
        preds = split_by_lengths(predicted.tolist(), lens)
        return (preds, list(stream.split(lens))) if with_streams else preds


class SparseTargetVerifier:
    name = "sparse"

    def __init__(self) -> None:
        self._target: Any = None  # step.TargetView
        self._stack: Any = None
        self._passes = 0

    def load(self, target: Any) -> None:
        from vllm_sparsever.compat.model import decoder_stack

        self._target = target
        self._stack = decoder_stack(target.model)

    @torch.inference_mode()
    def predict(self, rows: list[int], seqs: list[list[int]], first_positions: list[int], *,
                with_states: bool = False, state_layers: tuple[int, ...] | None = None) -> Any:
        """Predictions per request; `with_states`: (predictions, per request the target's states of
        its tokens an EAGLE head reads: the streams entering `state_layers` concatenated (EAGLE-3),
        or with None the final hidden states (EAGLE))."""
        from vllm_sparsever.forward_scope import active_plan
        from vllm_sparsever.plan import VerifyLevel, build_verification_plan

        target, stack = self._target, self._stack
        assert stack is not None, "SparseTargetVerifier.load() was not called"
        device = target.device
        tokens, positions, lens = flatten_queries(seqs, first_positions, device)
        batch = target.batch()
        rows_t = torch.tensor(rows, dtype=torch.long)
        self._passes += 1
        plan = build_verification_plan(
            step=self._passes,
            req_ids=[batch.req_ids[r] for r in rows],
            num_scheduled_tokens=np.asarray(lens),
            num_computed_tokens=np.asarray(first_positions),
            scheduled_spec_decode_tokens={batch.req_ids[r]: seq[1:] for r, seq in zip(rows, seqs, strict=True)},
            block_table=batch.block_table_cpu[rows_t],
            block_size=batch.block_size,
            device=device,
            level=VerifyLevel.INTERMEDIATE,
            verify_plain_rows=True,
            **target.step_planners(),
        )
        aux_layers = state_layers if with_states else None
        with active_plan(plan):
            out = final_hidden(target, stack, rows, tokens, positions, lens, aux_layers=aux_layers)
        normed, aux = out if aux_layers is not None else (out, None)
        preds = split_by_lengths(stack.compute_logits(normed).argmax(dim=-1).tolist(), lens)
        if not with_states:
            return preds
        states = normed if aux is None else torch.cat(aux, dim=-1)
        return preds, list(states.split(lens))
