"""Tree verification: acceptance of a draft tree from the target's logits, and the accepted path's
K/V moved into place.

One target forward runs every node of a request's tree (the root = its last accepted token, then
the drafts, parents first) under the ancestor mask (plan.TreeStep), so query token i's logits are
the target's next-token distribution after the path root..i. Acceptance walks down from the root:

- greedy: the child whose token is the target's argmax, while there is one; then the argmax itself
  (the correction, or the bonus at a leaf). Exactly the tokens non-speculative greedy emits.
- sampling: the children are deterministic candidates (the drafter's top tokens), so each is
  tested as a one-hot proposal against the target's *residual* distribution: accept child c with
  probability p(c) / (mass left), else remove c from p and try the next. If none is accepted, the
  token is sampled from what is left. Every emitted token is therefore distributed exactly as p
  (sampling by sequential elimination), whatever the drafter proposed: lossless.

The accepted path's nodes sit at slots ctx+i_1, ctx+i_2, ... (their query indices), and vLLM keeps
accepted tokens at ctx+1, ctx+2, ...: `compact_accepted_kv` copies their K/V there in every target
layer (i_j >= j, and all sources are gathered before any write). Rejected nodes' slots lie past
the new sequence end; vLLM overwrites them before they are read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm_sparsever.metrics import counters_summary
from vllm_sparsever.trees import DraftTopology


@dataclass
class TreeVerifyStats:
    steps: int = 0  # verify steps with at least one tree
    trees: int = 0  # tree requests verified
    nodes_verified: int = 0  # draft nodes (root excluded) the target ran
    accepted_tokens: int = 0  # accepted drafts along the paths
    kv_moved_tokens: int = 0  # accepted nodes whose K/V was moved into place

    def summary(self) -> dict[str, Any]:
        return {**counters_summary(self, "tree_", {"steps": "tree_verify_steps", "trees": "tree_verify_trees"}),
                "tree_mean_accepted_length": self.accepted_tokens / max(self.trees, 1)}


def accept_greedy(topology: DraftTopology, tokens: list[int], logits: torch.Tensor) -> tuple[list[int], int]:
    """(accepted node indices along the path, root excluded; the target's own next token).
    `tokens[i]`: query token i's id (tokens[0] the root); `logits[i]`: the target's after it."""
    children = topology.children()
    argmax = logits.argmax(dim=-1).tolist()
    path: list[int] = []
    node = 0
    while True:
        target = argmax[node]
        nxt = next((c for c in children[node] if tokens[c] == target), None)
        if nxt is None:
            return path, target
        path.append(nxt)
        node = nxt


def accept_sampled(topology: DraftTopology, tokens: list[int], probs: torch.Tensor,
                   generator: torch.Generator | None) -> tuple[list[int], int]:
    """As `accept_greedy` for a sampled request: `probs[i]` is the target's (temperature/top-k/
    top-p processed) distribution after query token i. Sequential elimination over the children."""
    children = topology.children()
    path: list[int] = []
    node = 0
    while True:
        residual = probs[node].double().clone()
        accepted = None
        for c in children[node]:
            token = tokens[c]
            mass = float(residual.sum())
            if mass <= 0.0:
                break
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            if u * mass < float(residual[token]):
                accepted = c
                break
            residual[token] = 0.0
        if accepted is None:
            if float(residual.sum()) <= 0.0:  # every token with mass was tried: cannot happen with a
                residual = probs[node].double()  # distinct-children tree; sample p itself
            token = int(torch.multinomial(residual, 1, generator=generator))
            return path, token
        path.append(accepted)
        node = accepted


def compact_accepted_kv(layer_kvs: list[Any], moves: list[tuple[int, int, list[int]]]) -> int:
    """Copy the K/V of accepted tree nodes into place in every layer: `moves` lists (batch row,
    context length, accepted node indices) per tree request; node i_j goes from position ctx+i_j
    to ctx+j. Returns the number of tokens moved (per layer)."""
    src_pos: list[tuple[int, int]] = []
    dst_pos: list[tuple[int, int]] = []
    for row, ctx, path in moves:
        for j, node in enumerate(path, start=1):
            if node != j:
                src_pos.append((row, ctx + node))
                dst_pos.append((row, ctx + j))
    if not src_pos or not layer_kvs:
        return len(src_pos)
    from vllm_sparsever.compat.cpu_attention import layer_isa
    from vllm_sparsever.verification.lossless.kv_layout import move_kv_tokens

    rows = torch.tensor([r for r, _ in src_pos], dtype=torch.long)
    src = torch.tensor([p for _, p in src_pos], dtype=torch.long)
    dst = torch.tensor([p for _, p in dst_pos], dtype=torch.long)
    for lkv in layer_kvs:
        bs = lkv.block_size
        src_blk = lkv.block_table[rows, src // bs].long()
        dst_blk = lkv.block_table[rows, dst // bs].long()
        device = lkv.kv_cache.device
        sb, so = src_blk.to(device), (src % bs).to(device)
        db, do = dst_blk.to(device), (dst % bs).to(device)
        move_kv_tokens(lkv.kv_cache, layer_isa(lkv.layer), sb, so, db, do)
        refresh = getattr(lkv.layer.impl, "refresh_summaries", None)
        if refresh is not None:
            refresh(lkv.layer, lkv.kv_cache, (db * bs + do).to(torch.long))
    return len(src_pos)


class TreeAcceptance:
    """Tree acceptance on verify steps, for the runner: counters, and the layers' KV caches (looked up
    once) that accepted paths are compacted in."""

    def __init__(self, layer_kvs: list[Any] | None = None) -> None:
        self.stats = TreeVerifyStats()
        # The target's attention layers' KV caches (compat.runner.LayerKV); None: looked up from the
        # runner on the first tree step.
        self._layer_kvs = layer_kvs

    def reset_stats(self) -> None:
        self.stats = TreeVerifyStats()

    def accept(self, runner: Any, plan: Any, logits: torch.Tensor, metadata: Any, output: Any) -> dict[str, list[int]]:
        """Tree acceptance for the step's tree requests (`plan.tree.tree_requests`), written over what
        vLLM's rejection sampler made of their rows (it reads them as chains), then the accepted
        paths' K/V moved into place. Returns each tree request's accepted path (query indices). Tree
        requests have plain sampling (the drafter checks); a sampled decision is made once for every
        TP rank."""
        from vllm_sparsever.compat import runner as vllm_runner
        from vllm_sparsever.compat.sampling import same_on_every_tp_rank

        stats = self.stats
        ends = vllm_runner.logits_row_ends(metadata)
        stats.steps += 1
        decisions, any_sampled = [], False
        for k in plan.tree.tree_requests:
            req = plan.requests[k]
            r = req.batch_index
            rows = logits[ends[r] - req.num_query_tokens: ends[r]]
            tokens = [-1, *req.draft_token_ids]
            how = vllm_runner.row_sampling(runner, r)
            if how.temperature is None:
                decisions.append(accept_greedy(req.topology, tokens, rows))  # same on every rank
            else:
                any_sampled = True
                probs = vllm_runner.processed_target_probs(rows, how.temperature, how.top_k, how.top_p)
                decisions.append(accept_sampled(req.topology, tokens, probs, how.generator))
        if any_sampled:
            decisions = same_on_every_tp_rank(decisions)
        paths, moves = {}, []
        for k, (path, final) in zip(plan.tree.tree_requests, decisions, strict=True):
            req = plan.requests[k]
            tokens = [-1, *req.draft_token_ids]
            vllm_runner.write_sampled_tokens(output, req.batch_index, [tokens[j] for j in path] + [final])
            moves.append((req.batch_index, req.context_len, path))
            paths[req.req_id] = path
            stats.trees += 1
            stats.nodes_verified += req.num_draft_tokens
            stats.accepted_tokens += len(path)
        if self._layer_kvs is None:
            from vllm_sparsever.compat.cpu_attention import attention_layer_names

            self._layer_kvs = vllm_runner.layer_kv_caches(runner, attention_layer_names(runner.model))
        stats.kv_moved_tokens += compact_accepted_kv(self._layer_kvs, moves)
        return paths
