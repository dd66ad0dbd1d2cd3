"""The step's inputs built over vLLM's runner from what compat/runner.py reads: the step API's objects
(step.py: each step's `DraftStep` and the `TargetView` proposers load with), the step's
`VerificationPlan` (plan.py) and its target states per request."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from vllm_sparsever.compat import runner as vllm_runner
from vllm_sparsever.plan import VerificationPlan, build_verification_plan
from vllm_sparsever.step import BatchRows, DraftStep, RequestLimits, draft_budgets, windowed_block_table


def verification_plan(runner: Any, step_index: int, scheduler_output: Any, num_scheduled_tokens: np.ndarray,
                      proposer: Any, runtime: Any, sparsify: bool) -> VerificationPlan:
    """The step's verification plan (built once, in `_prepare_inputs`), with the topologies of the
    proposer's draft trees."""
    batch = vllm_runner.input_batch_view(runner)
    drafts = vllm_runner.scheduled_drafts(scheduler_output)
    return build_verification_plan(
        step=step_index,
        req_ids=batch.req_ids,
        num_scheduled_tokens=num_scheduled_tokens,
        num_computed_tokens=batch.num_computed_tokens,
        scheduled_spec_decode_tokens=drafts,
        topologies=proposer.topologies(drafts) if proposer is not None else None,
        block_table=batch.block_table_cpu,
        block_size=batch.block_size,
        device=runner.device,
        sparsify=sparsify,
        **runtime.step_planners(),
    )


def hand_target_states(proposer: Any, layout: list[tuple[str, int, list[int]]], paths: dict[str, list[int]],
                       args: tuple, kwargs: dict) -> None:
    """The step's target states (from the arguments vLLM hands its drafter), per request, to the
    proposer: `layout` the step's tokens per request, `paths` the accepted tree paths."""
    from vllm_sparsever.compat.drafter import pass_states

    states = pass_states(args, kwargs, aux=proposer.state_layers is not None)
    if states is not None:
        for req_id, first, tokens, rows in states_by_request(layout, paths, states):
            proposer.observe_target_states(req_id, first, tokens, rows)


def draft_step(runner: Any, sampled_token_ids: list[list[int]], lookahead: int, depth: int) -> DraftStep:
    """The proposers' input of this step (the runner's batch after the step's bookkeeping): budgets
    for a proposer that writes up to `lookahead` positions per request, `depth` levels, and every
    row's limits."""
    req_ids, num_tokens, token_ids = vllm_runner.committed_tokens(runner)
    budgets, slot_limited = draft_budgets(sampled_token_ids, num_tokens, vllm_runner.allocated_slots(runner),
                                          lookahead, runner.model_config.max_model_len)
    limits = [RequestLimits(stops, remaining)
              for stops, remaining in vllm_runner.request_limits(runner, range(len(req_ids)))]
    return DraftStep(req_ids=req_ids, sampled=sampled_token_ids, num_tokens=num_tokens, budgets=budgets,
                     depth=depth, token_ids=token_ids, limits=limits, slot_limited=slot_limited)


class RunnerTargetView:
    """`step.TargetView` over a vLLM model runner, built once the target has loaded: the loaded target
    and the draft model vLLM loaded, the device and configs, the live batch, what a row's sampling
    allows, the n-gram bounds vLLM resolved, vLLM's own drafter's proposals, and attention contexts
    for sparsever's own query passes over the runner's KV cache."""

    def __init__(self, runner: Any, runtime: Any = None) -> None:
        """`runtime`: sparse verification's (verification.sparse.runtime), None where it is not set up."""
        self._runner = runner
        self._runtime = runtime
        self.moe_routing = runtime.moe_routing if runtime is not None else None  # (experts, top_k), MoE only
        self.linear_kernel = runtime.linear_kernel if runtime is not None else None

    def step_planners(self) -> dict[str, Any]:
        return self._runtime.step_planners() if self._runtime is not None else {}

    @property
    def model(self) -> Any:
        return self._runner.model

    @property
    def device(self) -> torch.device:
        return self._runner.device

    @property
    def vllm_config(self) -> Any:
        return self._runner.vllm_config

    @property
    def model_config(self) -> Any:
        return self._runner.model_config

    def draft_model(self) -> Any:
        return vllm_runner.draft_model(self._runner)

    def stop_token_ids(self) -> set[int]:
        return vllm_runner.eos_token_ids(self.model_config)

    def eagle_head(self) -> Any:
        from vllm_sparsever.compat.drafter import EagleHead

        return EagleHead(self._runner)

    def batch(self) -> BatchRows:
        return vllm_runner.input_batch_view(self._runner)

    def scheduled_token_ids(self, row: int, start: int, n: int) -> list[int]:
        return vllm_runner.scheduled_token_ids(self._runner, row, start, n)

    def tree_sampling_supported(self, row: int) -> bool:
        return vllm_runner.tree_sampling_supported(self._runner, row)

    def seeded_sampling(self, row: int) -> bool:
        return vllm_runner.seeded_sampling(self._runner, row)

    def ngram_bounds(self) -> tuple[int, int]:
        from vllm_sparsever.compat.ngram import ngram_bounds

        return ngram_bounds(self._runner)

    def record_vllm_drafter(self) -> Any:
        from vllm_sparsever.compat.drafter import record_drafter

        return record_drafter(self._runner)[0]

    def vllm_drafts(self) -> list[list[int]]:
        from vllm_sparsever.compat.drafter import proposed_drafts

        return proposed_drafts(self._runner)

    def step_contexts(self) -> list[int]:
        from vllm_sparsever.compat.drafter import step_contexts

        return step_contexts(self._runner)

    def block_table(self, layer_names: list[str]) -> tuple[torch.Tensor, int] | None:
        return vllm_runner.layers_block_table(self._runner, layer_names)

    def attention_context(self, layer_names: list[str], rows: torch.Tensor, positions: torch.Tensor,
                          query_lens: list[int], kv_positions: torch.Tensor | None = None,
                          block_table: torch.Tensor | None = None,
                          window: tuple[int, int] | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        read_window = None
        if window is not None:
            sink, recent = window
            read_window = functools.partial(windowed_block_table, sink=sink, recent=recent)
        return vllm_runner.query_attention_context(self._runner, layer_names, rows, positions, query_lens,
                                                   kv_positions=kv_positions, block_table=block_table,
                                                   read_window=read_window)


def states_by_request(layout: list[tuple[str, int, list[int]]], tree_paths: dict[str, list[int]],
                      states: torch.Tensor) -> list[tuple[str, int, list[int], torch.Tensor]]:
    """The step's target states (`states`, one row per scheduled token in `layout`'s order, from
    `compat.runner.step_token_layout`) per request: (req id, first position, token ids, rows). A
    verified tree keeps the root's and its accepted path's (`tree_paths`: query indices), which hold
    the positions after the root."""
    out = []
    offset = 0
    for req_id, first, tokens in layout:
        rows = states[offset: offset + len(tokens)]
        offset += len(tokens)
        path = tree_paths.get(req_id)
        if path is not None:
            keep = [0, *path]
            tokens, rows = [tokens[j] for j in keep], rows[keep]
        out.append((req_id, first, tokens, rows))
    return out
