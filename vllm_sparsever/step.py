"""The step API: what sparsever's proposers are handed each step and what they may read of the target,
owned by the plugin, on the base floor (plain data and narrow protocols; no vLLM).

- `DraftStep`: a step's input to a proposer, once the step's tokens are sampled and committed: per
  batch row its request, sampled tokens, token history, draft budget (`draft_budgets`) and
  `RequestLimits` (stop tokens, remaining max_tokens); for the step, the draft depth.
- `TargetView`: the read-only part of the target's runner a proposer holds from `Proposer.load` on
  (the loaded target and draft model, the live batch as `BatchRows`, what a row's sampling allows,
  attention contexts for the proposer's own passes over the target's KV cache), never the runner.
- `DraftPlan`: how a step's drafting runs, as the proposer plans it once the step's tokens are
  sampled (`Proposer.plan`): now or after the step's bookkeeping, vLLM's own drafter first or not,
  the step's target states handed over or not.
- `windowed_block_table`: the StreamingLLM window (sink + recent blocks) a query pass may read
  through instead of a request's whole block table.

`integration/step_inputs.py` builds both from what `compat/runner.py` reads of vLLM's runner; tree
types are in trees.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
import torch


@dataclass(frozen=True)
class RequestLimits:
    """What ends a request: the tokens that stop it and how many output tokens it may still emit."""

    stop_token_ids: frozenset[int]
    remaining_tokens: int | None  # None: no max_tokens


@dataclass(frozen=True)
class DraftStep:
    """A step's input to sparsever's proposers, read from vLLM's state once the step's tokens are
    sampled and committed (`integration.step_inputs.draft_step`). Per batch row: its request, the
    tokens sampled this step, its token count (prompt + accepted output, drafts excluded; the sampled
    token is the last), its draft budget: the positions from its sampled token on that its drafting
    may write this step (the proposer's lookahead, cut by max_model_len and the KV slots allocated to
    it; 0: it drafts nothing), and its limits (stop tokens, remaining max_tokens, counted from the
    tokens committed so far). For the whole step: `depth`, the draft levels to propose (the fixed cap,
    or the depth EVICT planned, `Proposer.plan_depth`; 0: skip drafting). The arrays view vLLM's
    buffers: read them within the step."""

    req_ids: list[str]
    sampled: list[list[int]]
    num_tokens: np.ndarray
    budgets: np.ndarray
    depth: int
    token_ids: np.ndarray  # [max_num_reqs, max_model_len]: the rows' tokens
    limits: Sequence[RequestLimits]  # per batch row
    slot_limited: int = 0  # rows whose allocated KV slots cut the lookahead (should stay 0)

    def history(self, row: int) -> np.ndarray:
        """The committed tokens of batch row `row` (prompt + accepted output, no drafts)."""
        return self.token_ids[row, : int(self.num_tokens[row])]

    def limits_of(self, rows: Sequence[int]) -> list[RequestLimits]:
        """The limits of batch rows `rows`, in that order."""
        return [self.limits[row] for row in rows]

    def with_depth(self, depth: int) -> "DraftStep":
        return replace(self, depth=depth)


@dataclass(frozen=True)
class DraftPlan:
    """How a step's drafting runs (`Proposer.plan`, asked once per step right after sampling)."""

    # Propose from the step's committed tokens, once vLLM's sample_tokens has done its bookkeeping
    # (needs synchronous scheduling); else inside the step, where vLLM's drafter would propose.
    after_bookkeeping: bool = False
    # vLLM's own drafter runs this many draft steps first (its drafts are the proposer's to cut); 0: it
    # does not run.
    vllm_depth: int = 0
    # The target's states of the step's tokens are handed over per request (`observe_target_states`)
    # before the proposal.
    target_states: bool = False


def draft_budgets(sampled: list[list[int]], num_tokens: np.ndarray, allocated: np.ndarray, lookahead: int,
                  max_model_len: int) -> tuple[np.ndarray, int]:
    """Per batch row, the positions from its sampled token on that its drafting may write (0 for a row
    that sampled nothing), and how many rows the allocated KV slots cut: the scheduler reserves
    `lookahead` slots for sparsever's proposers (`integration.speculative.self_draft_lookahead`)."""
    budgets = np.zeros(len(sampled), dtype=np.int64)
    slot_limited = 0
    for row, tokens in enumerate(sampled):
        if not tokens:
            continue
        position = int(num_tokens[row]) - 1  # where the token sampled this step sits
        budget = min(lookahead, max_model_len - position - 1)
        if int(allocated[row]) - position < budget:  # never write K/V past a request's allocated slots
            budget = int(allocated[row]) - position
            slot_limited += 1
        budgets[row] = max(0, budget)
    return budgets, slot_limited


def windowed_block_table(table: torch.Tensor, seq_lens: torch.Tensor, first_queries: torch.Tensor, block_size: int,
                         sink: int, recent: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block table, sequence lengths) that read, per request, only the blocks holding positions
    < `sink` and those from min(first query position, seq_len - `recent`) on, in order: queries at the
    end of a sequence attend causally to that part of it (StreamingLLM's sink + recent window, on
    whole blocks). `table` [reqs, blocks] (CPU), `seq_lens` / `first_queries` [reqs]."""
    out, lens = table.clone(), seq_lens.clone()
    num_sink = -(-sink // block_size)
    for i in range(int(table.shape[0])):
        length = int(seq_lens[i])
        start = min(int(first_queries[i]), max(0, length - recent)) // block_size
        if start <= num_sink:
            continue
        last = (length - 1) // block_size
        kept = torch.cat([table[i, :num_sink], table[i, start: last + 1]])
        out[i, : kept.numel()] = kept
        lens[i] = num_sink * block_size + length - start * block_size
    return out, lens


class BatchRows(Protocol):
    """The live batch (rows 0..num_reqs-1), as a step's plan and a proposer's own passes read it."""

    @property
    def req_ids(self) -> list[str]: ...

    @property
    def num_reqs(self) -> int: ...

    @property
    def num_computed_tokens(self) -> np.ndarray:
        """[>= num_reqs] (CPU, vLLM's buffer: read, do not keep)."""

    @property
    def block_table_cpu(self) -> torch.Tensor:
        """[>= num_reqs, max_blocks], KV cache group 0."""

    @property
    def block_size(self) -> int: ...


class TargetView(Protocol):
    """The part of the target's runner that sparsever's proposers use, handed to `Proposer.load` once
    the target has loaded: proposers hold this, never the runner. Read-only: nothing here changes
    vLLM's state."""

    @property
    def model(self) -> Any:
        """The loaded target model."""

    @property
    def device(self) -> torch.device: ...

    @property
    def vllm_config(self) -> Any: ...

    @property
    def model_config(self) -> Any: ...

    @property
    def moe_routing(self) -> tuple[int, int] | None:
        """The target's (experts, top_k), MoE targets only."""

    @property
    def linear_kernel(self) -> str | None:
        """The linear kernel the target's dense linears run on (sparse verification's, resolved);
        None without sparse verification set up (offline tools)."""

    def step_planners(self) -> dict[str, Any]:
        """What a verification plan over the target needs from sparse verification
        (`plan.build_verification_plan`'s planners), for a proposer's own passes over the target."""

    def draft_model(self) -> Any:
        """The draft model vLLM loaded for its `draft_model` method (ValueError without one)."""

    def stop_token_ids(self) -> set[int]:
        """The target's end-of-sequence tokens (its config's and its generation config's)."""

    def eagle_head(self) -> Any:
        """The EAGLE / EAGLE-3 head vLLM loaded, as sparsever runs it (compat.drafter.EagleHead)."""

    def batch(self) -> BatchRows:
        """The live batch."""

    def scheduled_token_ids(self, row: int, start: int, n: int) -> list[int]:
        """The `n` token ids batch row `row` runs this step from position `start`."""

    def tree_sampling_supported(self, row: int) -> bool:
        """Whether batch row `row`'s sampling is plain enough for tree acceptance."""

    def seeded_sampling(self, row: int) -> bool:
        """Whether batch row `row` samples with a seed."""

    def ngram_bounds(self) -> tuple[int, int]:
        """(min n, max n) of vLLM's n-gram drafter."""

    def record_vllm_drafter(self) -> Any:
        """A recorder of vLLM's drafter's passes (time, per-step draft probabilities)."""

    def vllm_drafts(self) -> list[list[int]]:
        """The drafts vLLM's drafter proposed this step, per batch row."""

    def step_contexts(self) -> list[int]:
        """Per request of the step being run, its context length (what vLLM's drafter drafts after)."""

    def block_table(self, layer_names: list[str]) -> tuple[torch.Tensor, int] | None:
        """The block table (CPU, per batch row) and block size `layer_names` share, if one."""

    def attention_context(self, layer_names: list[str], rows: torch.Tensor, positions: torch.Tensor,
                          query_lens: list[int], kv_positions: torch.Tensor | None = None,
                          block_table: torch.Tensor | None = None,
                          window: tuple[int, int] | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """(per-layer attention metadata, per-layer slot mapping) for `query_lens[i]` consecutive
        query tokens of batch row `rows[i]` at `positions`, each attending causally to its request's
        KV (`compat.runner.query_attention_context`); `window` (sink, recent) reads through
        `windowed_block_table`."""
