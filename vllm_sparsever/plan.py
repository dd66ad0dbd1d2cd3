"""The per-step verification plan: which requests verify, where their draft tokens sit, their KV.

Built once per step by the model runner (FlashInfer's plan/run split: indices and metadata are
computed once, then read by every layer and kernel of the step). Layers read it through
`current_plan()`. Under torch.compile a Python branch on the plan would be frozen at trace time,
so per-step behaviour must be read inside opaque custom ops (as vLLM's
`unified_attention_with_output` reads the forward context); `verify_token_mask` is the first such
op and the pattern the sparse layers follow.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch


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

    @property
    def draft_token_positions(self) -> range:
        """Positions (in the step's flattened tokens) of the draft tokens."""
        first = self.query_start + self.num_query_tokens - self.num_draft_tokens
        return range(first, first + self.num_draft_tokens)


@dataclass
class VerificationPlan:
    """What the target forward of one step has to verify.

    Tensors are on the runner's device and indexed by the step's batch rows:
    `query_start_loc [num_reqs + 1]`, `seq_lens [num_reqs]`, `num_draft_tokens [num_reqs]`,
    `block_table [num_reqs, max_blocks]` (physical KV block ids, KV cache group 0),
    `token_is_verify [num_tokens]` (1 for every token of a verifying request).
    """

    step: int
    num_reqs: int
    num_tokens: int
    block_size: int
    requests: list[RequestVerification]
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    num_draft_tokens: torch.Tensor
    block_table: torch.Tensor
    token_is_verify: torch.Tensor
    extras: dict = field(default_factory=dict)

    @property
    def is_verify_step(self) -> bool:
        return bool(self.requests)

    @property
    def total_draft_tokens(self) -> int:
        return sum(r.num_draft_tokens for r in self.requests)

    def request(self, req_id: str) -> RequestVerification | None:
        for r in self.requests:
            if r.req_id == req_id:
                return r
        return None

    def kv_block_ids(self, req: RequestVerification) -> torch.Tensor:
        """Physical KV block ids holding `req`'s sequence (context + this step's tokens)."""
        num_blocks = (req.seq_len + self.block_size - 1) // self.block_size
        return self.block_table[req.batch_index, :num_blocks]


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
) -> VerificationPlan:
    """Build the plan from the scheduler's view of the step (host-side numpy, one pass).

    A request verifies when all its scheduled tokens are its last sampled token plus its drafts;
    a chunked-prefill row that also carries drafts is not a verify row (its drafts get rolled
    back by vLLM), so it is left dense.
    """
    num_reqs = len(req_ids)
    num_scheduled = np.asarray(num_scheduled_tokens[:num_reqs], dtype=np.int64)
    computed = np.asarray(num_computed_tokens[:num_reqs], dtype=np.int64)
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(num_scheduled, out=query_start_loc[1:])
    seq_lens = computed + num_scheduled
    num_tokens = int(query_start_loc[-1])

    num_drafts = np.zeros(num_reqs, dtype=np.int64)
    token_is_verify = np.zeros(num_tokens, dtype=np.bool_)
    requests: list[RequestVerification] = []
    for i, req_id in enumerate(req_ids):
        drafts = scheduled_spec_decode_tokens.get(req_id) or []
        if not drafts or num_scheduled[i] != len(drafts) + 1:
            continue
        num_drafts[i] = len(drafts)
        start, stop = int(query_start_loc[i]), int(query_start_loc[i + 1])
        token_is_verify[start:stop] = True
        requests.append(
            RequestVerification(
                req_id=req_id,
                batch_index=i,
                query_start=start,
                num_query_tokens=stop - start,
                num_draft_tokens=len(drafts),
                context_len=int(computed[i]),
                seq_len=int(seq_lens[i]),
                draft_token_ids=tuple(int(t) for t in drafts),
            )
        )

    return VerificationPlan(
        step=step,
        num_reqs=num_reqs,
        num_tokens=num_tokens,
        block_size=block_size,
        requests=requests,
        query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)).to(device),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
        num_draft_tokens=torch.from_numpy(num_drafts.astype(np.int32)).to(device),
        block_table=block_table[:num_reqs].to(device),
        token_is_verify=torch.from_numpy(token_is_verify).to(device),
    )


# ---- the plan of the step being run ---------------------------------------------------------

_current: VerificationPlan | None = None


def current_plan() -> VerificationPlan | None:
    """The plan of the target forward now running, or None outside one (draft model, warm-up)."""
    return _current


@contextlib.contextmanager
def active_plan(plan: VerificationPlan | None) -> Iterator[None]:
    """Make `plan` visible to layers and ops for the duration of one target forward."""
    global _current
    previous, _current = _current, plan
    try:
        yield
    finally:
        _current = previous


@torch.library.custom_op("sparsever_plan::verify_token_mask", mutates_args=())
def verify_token_mask(hidden_states: torch.Tensor) -> torch.Tensor:
    """Per-token 1.0/0.0 mask of the tokens under verification in the current step.

    Opaque to torch.compile, so a compiled graph reads the plan of the step it runs, not the one
    it was traced with. Padded tokens (beyond the plan) and steps without a plan get 0.
    """
    num_tokens = hidden_states.shape[0]
    out = torch.zeros(num_tokens, dtype=hidden_states.dtype, device=hidden_states.device)
    plan = _current
    if plan is not None and plan.is_verify_step:
        n = min(num_tokens, plan.num_tokens)
        out[:n] = plan.token_is_verify[:n].to(out.dtype)
    return out


@verify_token_mask.register_fake
def _(hidden_states: torch.Tensor) -> torch.Tensor:
    return hidden_states.new_empty(hidden_states.shape[0])
