"""vLLM's model-based drafters (`eagle`, `eagle3`, `mtp`: `SpecDecodeBaseProposer`, vllm/v1/spec_decode/
llm_base_proposer.py) as sparsever reads them, to let EVICT cut their chains.

Private symbols touched:
- `runner.drafter` (the proposer instance) and its `propose(...)` (timed: the step's drafting);
- `drafter._greedy_sample(hidden_states) -> token ids` (called once per draft step with every
  request's last hidden state; replaced on the instance to also keep each draft's probability:
  the softmax maximum over the logits it takes the argmax of); `drafter.use_local_argmax_reduction`
  and `drafter.use_heterogeneous_vocab` / `drafter.vocab_mapping` (`constrain_draft_logits`,
  `map_draft_to_target_ids`), which change how it samples; `drafter.model.compute_logits`;
- `SchedulerOutput.num_spec_tokens_to_schedule` (vLLM's dynamic speculation: the draft steps the
  runner's `propose_draft_token_ids` has the drafter run; the mixin hands it a copy carrying the
  depth EVICT plans, never above the configured value the drafter's buffers were sized for);
- `runner._draft_token_ids` (what the drafter proposed this step: a [rows, k] tensor, or lists);
- `runner.input_batch.num_tokens_no_spec` / `num_reqs` before the step's bookkeeping (each row's
  tokens before this step's: the context EVICT prices the step at).

For hierarchical verification sparsever runs an EAGLE / EAGLE-3 head itself (`EagleHead`):
- `drafter.method`, `drafter.model` (vLLM's `Eagle3LlamaForCausalLM` / `EagleLlamaForCausalLM`, ...):
  `forward(input_ids, positions, hidden_states) -> (hidden for logits, hidden fed to the next draft
  step)`, `combine_hidden_states(aux streams concatenated)` (EAGLE-3), `compute_logits` (target
  vocabulary: a trimmed draft vocabulary is mapped back inside), `model.model.layers[i].self_attn.attn
  .layer_name` (the head's KV cache layers, in the target's KV cache group);
- `drafter.use_heterogeneous_vocab` (heads whose input ids need a vocabulary mapping: refused);
- the runner's `propose_draft_token_ids(scheduler_output, sampled_token_ids, sampling_metadata,
  hidden_states, sample_hidden_states, aux_hidden_states, ...)`: the target's final hidden states and
  aux streams of the step's tokens (`pass_states`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


class DraftRecorder:
    """What vLLM's drafter did in the current step: its time, and per draft step the probability of
    each row's draft (empty when the drafter sampled without `_greedy_sample`, e.g. probabilistic
    draft sampling, or with the local argmax reduction, which never forms the probabilities)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.probabilities: list[torch.Tensor] = []

    def start(self) -> None:
        self.seconds = 0.0
        self.probabilities = []


def record_drafter(runner: Any) -> tuple[DraftRecorder, Callable[[], None]]:
    """Instrument `runner.drafter` (on the instance); returns the recorder and an undo."""
    drafter = runner.drafter
    recorder = DraftRecorder()
    propose, greedy = drafter.propose, drafter._greedy_sample

    def timed_propose(*args: Any, **kwargs: Any) -> Any:
        recorder.start()
        start = time.perf_counter()
        try:
            return propose(*args, **kwargs)
        finally:
            recorder.seconds = time.perf_counter() - start

    def greedy_with_probabilities(hidden_states: torch.Tensor) -> torch.Tensor:
        if drafter.use_local_argmax_reduction:
            return greedy(hidden_states)
        logits = drafter.model.compute_logits(hidden_states)
        if drafter.use_heterogeneous_vocab:
            logits = drafter.vocab_mapping.constrain_draft_logits(logits)
        probabilities, ids = torch.softmax(logits.float(), dim=-1).max(dim=-1)
        recorder.probabilities.append(probabilities)
        if drafter.use_heterogeneous_vocab:
            return drafter.vocab_mapping.map_draft_to_target_ids(ids)
        return ids

    drafter.propose = timed_propose
    drafter._greedy_sample = greedy_with_probabilities

    def undo() -> None:
        del drafter.propose, drafter._greedy_sample  # back to the class's methods

    return recorder, undo


def proposed_drafts(runner: Any) -> list[list[int]]:
    """The drafts vLLM's drafter proposed this step, per batch row."""
    drafts = runner._draft_token_ids
    if drafts is None:
        return []
    return drafts.tolist() if isinstance(drafts, torch.Tensor) else [list(d) for d in drafts]


def with_draft_depth(scheduler_output: Any, depth: int, configured: int) -> Any:
    """A copy of the step's scheduler output whose drafter runs `depth` draft steps (1 <= depth <=
    `configured`, the engine's num_speculative_tokens); the scheduler's own object is left alone."""
    import dataclasses

    if not 1 <= depth <= configured:
        raise ValueError(f"draft depth {depth} outside 1..{configured}")
    return dataclasses.replace(scheduler_output, num_spec_tokens_to_schedule=depth)


def step_contexts(runner: Any) -> list[int]:
    """Per batch row, its tokens before this step's (read before the step's bookkeeping)."""
    batch = runner.input_batch
    return [int(n) for n in batch.num_tokens_no_spec[: batch.num_reqs]]


EAGLE_HEAD_METHODS = ("eagle", "eagle3")


class EagleHead:
    """An EAGLE (final hidden states) or EAGLE-3 (aux layer streams) head that vLLM loaded, run by
    sparsever on the target's KV cache: the target's states of a token and the next token in, the
    head's hidden state and next-token logits out."""

    def __init__(self, runner: Any) -> None:
        drafter = getattr(runner, "drafter", None)
        method = getattr(drafter, "method", None)
        if method not in EAGLE_HEAD_METHODS:
            raise ValueError(f"the runner's drafter is {method!r}, an EAGLE head expected "
                             f"(allowed: {', '.join(EAGLE_HEAD_METHODS)})")
        if drafter.use_heterogeneous_vocab:
            raise ValueError("EAGLE heads with a heterogeneous vocabulary mapping are not run by sparsever")
        self.method = method
        self.model = drafter.model
        self.layer_names = [layer.self_attn.attn.layer_name for layer in self.model.model.layers]

    @property
    def reads_aux_streams(self) -> bool:
        """EAGLE-3: the head reads the target's aux layer streams (else its final hidden states)."""
        return self.method == "eagle3"

    def combine(self, states: torch.Tensor) -> torch.Tensor:
        """The head's input hidden states from the target's (aux streams concatenated, EAGLE-3; or
        final hidden states, EAGLE)."""
        return self.model.combine_hidden_states(states) if self.reads_aux_streams else states

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states for the logits, hidden states for the next draft step), inside a forward
        context whose metadata covers `layer_names`."""
        out = self.model(input_ids=input_ids, positions=positions, hidden_states=hidden_states)
        return out if isinstance(out, tuple) else (out, out)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden_states)


PROPOSE_STATE_ARGS = ("hidden_states", "aux_hidden_states")


def pass_states(args: tuple, kwargs: dict, aux: bool) -> torch.Tensor | None:
    """From the arguments of the runner's `propose_draft_token_ids` (after scheduler_output and
    sampled_token_ids): the target's states of the step's tokens that a head reads, [tokens, ...]:
    its aux streams concatenated (`aux`, EAGLE-3) or its final hidden states; None if absent."""
    names = ("sampling_metadata", "hidden_states", "sample_hidden_states", "aux_hidden_states")
    given = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    if aux:
        streams = given.get("aux_hidden_states")
        return None if not streams else torch.cat(list(streams), dim=-1)
    return given.get("hidden_states")
