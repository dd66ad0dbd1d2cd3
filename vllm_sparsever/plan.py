"""The per-step verification plan: typed, built once per step, read-only for layers.

FlashInfer's plan/run split: the model runner calls `build_verification_plan` once per step, after
vLLM has prepared the step's inputs and before the target forward. Everything that depends only on
the batch is computed there, once: which requests verify and where their draft tokens sit
(`RequestVerification`), the token groups the FFN/MoE kernels run over (`TokenGroups`), and, when
sparse attention is active, the attention rows, kept-block counts, compacted sequence lengths and
kernel scheduling metadata (`AttentionStepPlan`, built by the attention backend's planner). Layers
read the plan of the forward now running through `forward_scope.current_plan()` and never write it.

The one thing a plan cannot know before the forward is what the anchor layers select (selection
scores the anchor's own queries). Those selections go into the plan's `AnchorSelections`, a typed
per-step store: an anchor layer publishes its selection once, and every other layer reads the
selection of *its* anchor (the nearest anchor at or below it), so what a layer sees never depends on
which layer happened to run last.

`VerifyLevel` says which level a forward verifies at: the full target (vLLM's step), or the
intermediate level of hierarchical verification when that level is the sparse target (a plan built
by drafting/intermediate.py for its own forward; the full level is then planned dense). Every request
carries a `DraftTopology` (trees.py: a chain, or a draft tree's parents; tree attention reads the
step's ancestor mask, `TreeStep`, built from them).

Under torch.compile a Python branch on the plan would be frozen at trace time, so per-step
behaviour is read inside opaque custom ops (as vLLM's `unified_attention_with_output` reads the
forward context): the sparse FFN and MoE wrappers are such ops.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm_sparsever.trees import DraftTopology, stacked_tree_mask


class VerifyLevel(enum.Enum):
    """Which verifier a target forward acts as."""

    FULL = "full"  # the whole target: its tokens are final
    # Hierarchical verification's level 1 (drafting/hierarchical.py): the tokens it keeps are only
    # pending until a FULL forward verifies them.
    INTERMEDIATE = "intermediate"


@dataclass(frozen=True)
class RequestVerification:
    """One request that verifies draft tokens in this step."""

    req_id: str
    batch_index: int  # row in the runner's persistent batch (and in the step's token layout)
    query_start: int  # first token of this request in the step's flattened tokens
    num_query_tokens: int  # last accepted token + draft tokens
    num_draft_tokens: int
    context_len: int  # tokens already in the KV cache before this step
    seq_len: int  # context_len + num_query_tokens
    draft_token_ids: tuple[int, ...]
    topology: DraftTopology

    @property
    def draft_token_positions(self) -> range:
        """Positions (in the step's flattened tokens) of the draft tokens."""
        first = self.query_start + self.num_query_tokens - self.num_draft_tokens
        return range(first, first + self.num_draft_tokens)


@dataclass(frozen=True)
class TokenGroups:
    """The tokens a verify step sparsifies, one group per verifying request.

    `all_tokens_verify`: every token of the step belongs to a verify group, in order, so layers run
    on the hidden states as they are (no gather). Otherwise `token_index` gathers the verify tokens
    and the rest (prefill chunks, plain decode rows, padding) go through the dense path.
    """

    num_tokens: int
    all_tokens_verify: bool
    token_index: torch.Tensor  # [Tv] long, positions of verify tokens in the step
    other_index: torch.Tensor  # [T - Tv] long, the remaining (dense) tokens
    group_start_loc: torch.Tensor  # [G+1] int32, indexes the gathered (or full) verify tokens
    batch_rows: tuple[int, ...]  # the runner's batch row of each group (request)

    @property
    def num_groups(self) -> int:
        return len(self.batch_rows)

    def dense_index(self, num_rows: int) -> torch.Tensor:
        """Rows of a hidden-state tensor with `num_rows` rows that take the dense path: the
        non-verify tokens plus any padding past the step's tokens."""
        if num_rows <= self.num_tokens:
            return self.other_index
        pad = torch.arange(self.num_tokens, num_rows, device=self.other_index.device)
        return torch.cat([self.other_index, pad])


@dataclass(frozen=True)
class AttentionStepPlan:
    """Sparse attention's view of one verify step (KV cache group 0), computed once per step.

    Per batch row r: `query_lens[r]`, `seq_lens[r]`; `sparse_rows[r]` when the row is a verify row
    with enough context to select from; `kept_blocks[r]`, the context blocks it reads per KV head
    (every context block for dense rows); `compacted_seq_lens[r]`, the length a dense kernel sees
    over the compacted block table (kept blocks, then the query's own blocks).
    """

    run_sparse: bool  # False: the step attends densely (nothing to save, or a prefill chunk)
    query_lens: torch.Tensor  # [R] int32
    sparse_rows: torch.Tensor  # [R] bool
    kept_blocks: torch.Tensor  # [R] int32
    compacted_seq_lens: torch.Tensor  # [R] int32
    kv_blocks_read: int  # (row, KV head, block) reads of one sparse layer
    kv_blocks_dense: int  # the same for dense attention
    kernel_metadata: Any = None  # the attention kernel's work split for `compacted_seq_lens`
    # (block size, heads, KV heads, head size) the step was planned for; a layer of other shapes
    # must not use it.
    geometry: tuple[int, int, int, int] = (0, 0, 0, 0)


@dataclass(frozen=True)
class AnchorSelection:
    """The KV blocks one anchor layer selected, reused by the layers up to the next anchor."""

    layer: int
    selected: torch.Tensor  # [R, heads, S] int32 logical block ids, ascending, -1 past num_selected
    num_selected: torch.Tensor  # [R, heads] int32
    block_table: torch.Tensor | None = None  # compacted physical block table (vLLM-kernel path)


class AnchorSelectionUnavailable(LookupError):
    """A layer's anchor published no selection this step (the anchor verified densely)."""


class AnchorSelections:
    """Per-step store of anchor selections: written once per anchor, read by the layers it governs.

    `anchors` None means every layer is its own anchor. Layer 0 always anchors, so every layer has
    one.
    """

    def __init__(self, anchors: Sequence[int] | None) -> None:
        self._anchors = None if anchors is None else sorted(set(anchors) | {0})
        self._by_anchor: dict[int, AnchorSelection] = {}

    def is_anchor(self, layer: int) -> bool:
        return self._anchors is None or layer in self._anchors

    def anchor_of(self, layer: int) -> int:
        if self._anchors is None:
            return layer
        return self._anchors[bisect.bisect_right(self._anchors, layer) - 1]

    def publish(self, selection: AnchorSelection) -> None:
        if not self.is_anchor(selection.layer):
            raise ValueError(f"layer {selection.layer} is not an anchor (anchors: {self._anchors})")
        if selection.layer in self._by_anchor:
            raise ValueError(f"anchor layer {selection.layer} already published its selection this step")
        self._by_anchor[selection.layer] = selection

    def for_layer(self, layer: int) -> AnchorSelection:
        anchor = self.anchor_of(layer)
        found = self._by_anchor.get(anchor)
        if found is None:
            raise AnchorSelectionUnavailable(f"anchor layer {anchor} of layer {layer} has no selection")
        return found

    def __len__(self) -> int:
        return len(self._by_anchor)


@dataclass(frozen=True)
class TreeStep:
    """What a step with draft trees needs besides the chain layout (built once per step)."""

    # [T, max_q_len] uint8: row t may attend to query token j of its request (causal rows for
    # requests without a tree): `block_sparse_tree_attention`'s tree_mask.
    mask: torch.Tensor
    # [T] long: each token's rotary position (context length + depth for tree tokens).
    positions: torch.Tensor
    # The requests whose topology is not a chain (acceptance walks their trees).
    tree_requests: tuple[int, ...]  # indexes into VerificationPlan.requests


@dataclass(frozen=True)
class VerificationPlan:
    """What the target forward of one step verifies, and how (see the module docstring)."""

    step: int
    num_reqs: int
    num_tokens: int
    block_size: int
    level: VerifyLevel
    requests: tuple[RequestVerification, ...]
    groups: TokenGroups | None  # None when nothing verifies
    attention: AttentionStepPlan | None  # None when sparse attention is not active this step
    selections: AnchorSelections = field(compare=False)
    tree: TreeStep | None = None  # None when every request verifies a chain
    # A row of the step is a prefill chunk (several tokens, not a verify row): the step attends
    # with vLLM's kernel, which schedules prefill work.
    has_prefill_rows: bool = False

    @property
    def is_verify_step(self) -> bool:
        return bool(self.requests)

    @property
    def total_draft_tokens(self) -> int:
        return sum(r.num_draft_tokens for r in self.requests)


@dataclass(frozen=True)
class StepBatch:
    """The scheduler's view of one step, host side (what `build_verification_plan` reads)."""

    req_ids: Sequence[str]
    num_scheduled_tokens: np.ndarray  # [num_reqs]
    num_computed_tokens: np.ndarray  # [>= num_reqs]
    scheduled_spec_decode_tokens: dict[str, list[int]]
    block_table: torch.Tensor  # [>= num_reqs, max_blocks] int32, KV cache group 0
    block_size: int

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


def build_verification_plan(
    *,
    step: int,
    req_ids: Sequence[str],
    num_scheduled_tokens: np.ndarray,
    num_computed_tokens: np.ndarray,
    scheduled_spec_decode_tokens: dict[str, list[int]],
    block_table: torch.Tensor,
    block_size: int,
    device: torch.device | str = "cpu",
    anchor_layers: Sequence[int] | None = None,
    attention_planner: Any = None,
    level: VerifyLevel = VerifyLevel.FULL,
    sparsify: bool = True,
    verify_plain_rows: bool = False,
    topologies: dict[str, DraftTopology] | None = None,
) -> VerificationPlan:
    """Build the step's plan (host-side numpy, one pass over the batch).

    A request verifies when all its scheduled tokens are its last sampled token plus its drafts;
    a chunked-prefill row that also carries drafts is not a verify row (its drafts get rolled
    back by vLLM), so it is left dense. `attention_planner(batch, requests, query_start_loc)`
    returns the step's `AttentionStepPlan` (or None); it is given only on verify steps with
    sparse attention active.

    `sparsify=False` plans a dense verification (no token groups, no attention plan): the full
    level of a hierarchy whose intermediate level is the sparse target. `verify_plain_rows`: a row
    of one token and no drafts verifies too (the sparse intermediate level predicts its next token
    sparsely, as a sparse self-drafter would).
    """
    batch = StepBatch(req_ids, num_scheduled_tokens, num_computed_tokens, scheduled_spec_decode_tokens,
                      block_table, block_size)
    num_reqs = batch.num_reqs
    num_scheduled = np.asarray(num_scheduled_tokens[:num_reqs], dtype=np.int64)
    computed = np.asarray(num_computed_tokens[:num_reqs], dtype=np.int64)
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(num_scheduled, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])

    requests: list[RequestVerification] = []
    for i, req_id in enumerate(req_ids):
        drafts = scheduled_spec_decode_tokens.get(req_id) or []
        if num_scheduled[i] != len(drafts) + 1 or not (drafts or verify_plain_rows):
            continue
        start, stop = int(query_start_loc[i]), int(query_start_loc[i + 1])
        topology = (topologies or {}).get(req_id)
        if topology is None or len(topology.parents) < stop - start:
            topology = DraftTopology.chain(stop - start)
        else:
            topology = topology.prefix(stop - start)
        requests.append(
            RequestVerification(
                req_id=req_id,
                batch_index=i,
                query_start=start,
                num_query_tokens=stop - start,
                num_draft_tokens=len(drafts),
                context_len=int(computed[i]),
                seq_len=int(computed[i] + num_scheduled[i]),
                draft_token_ids=tuple(int(t) for t in drafts),
                topology=topology,
            )
        )

    verify_rows = {req.batch_index for req in requests}
    has_prefill_rows = any(num_scheduled[i] > 1 and i not in verify_rows for i in range(num_reqs))
    groups = _token_groups(requests, num_tokens, device) if requests and sparsify else None
    attention = None
    # A prefill chunk in the step: vLLM's kernel runs it all (it schedules prefill work), so no plan.
    if requests and sparsify and attention_planner is not None and not has_prefill_rows:
        attention = attention_planner(batch, requests, query_start_loc)
    return VerificationPlan(
        step=step,
        num_reqs=num_reqs,
        num_tokens=num_tokens,
        block_size=block_size,
        level=level,
        requests=tuple(requests),
        groups=groups,
        attention=attention,
        selections=AnchorSelections(anchor_layers),
        tree=_tree_step(requests, num_scheduled, computed, query_start_loc, device),
        has_prefill_rows=has_prefill_rows,
    )


def _tree_step(requests: list[RequestVerification], num_scheduled: np.ndarray, computed: np.ndarray,
               query_start_loc: np.ndarray, device) -> TreeStep | None:
    trees = tuple(k for k, req in enumerate(requests) if not req.topology.is_chain)
    if not trees:
        return None
    # Every row of the step in batch order: a verify row's topology, causal for the others.
    topologies = [DraftTopology.chain(int(n)) for n in num_scheduled]
    for req in requests:
        topologies[req.batch_index] = req.topology
    positions = torch.cat([
        int(computed[r]) + torch.tensor(t.depths(), dtype=torch.long) if t.parents else torch.empty(0, dtype=torch.long)
        for r, t in enumerate(topologies)
    ])
    return TreeStep(mask=stacked_tree_mask(topologies).to(device), positions=positions.to(device),
                    tree_requests=trees)


def _token_groups(requests: list[RequestVerification], num_tokens: int, device) -> TokenGroups:
    starts = [0]
    index: list[int] = []
    for req in requests:  # requests are in batch (token) order
        index.extend(range(req.query_start, req.query_start + req.num_query_tokens))
        starts.append(len(index))
    is_verify = np.zeros(num_tokens, dtype=np.bool_)
    is_verify[index] = True
    return TokenGroups(
        num_tokens=num_tokens,
        all_tokens_verify=len(index) == num_tokens,
        token_index=torch.tensor(index, dtype=torch.long, device=device),
        other_index=torch.from_numpy(np.flatnonzero(~is_verify)).to(device),
        group_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        batch_rows=tuple(r.batch_index for r in requests),
    )
