"""Query batches for sparsever's own forward passes on the target worker's KV cache (the
intermediate verifiers, the draft-model drafter): requests' consecutive tokens flattened request
after request, and a whole decoder stack run over them."""

from __future__ import annotations

from typing import Any

import torch


def flatten_queries(
    seqs: list[list[int]], first_positions: list[int], device: Any
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(tokens, positions, lengths) of `seqs[i]` run from position `first_positions[i]` on."""
    tokens, positions, lens = [], [], []
    for seq, first in zip(seqs, first_positions, strict=True):
        tokens.extend(seq)
        positions.extend(range(first, first + len(seq)))
        lens.append(len(seq))
    as_long = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
    return as_long(tokens), as_long(positions), lens


def split_by_lengths(flat: list[int], lens: list[int]) -> list[list[int]]:
    """`flat` cut back into the requests' runs of `lens` items."""
    out, offset = [], 0
    for length in lens:
        out.append(flat[offset: offset + length])
        offset += length
    return out


def run_query(target: Any, stack: Any, rows: Any, tokens: torch.Tensor, positions: torch.Tensor,
              lens: list[int], *, num_layers: int | None = None, kv_positions: torch.Tensor | None = None,
              tree_mask: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
              aux_layers: tuple[int, ...] | None = None, window: tuple[int, int] | None = None) -> Any:
    """The first `num_layers` layers of `stack` (a compat.model.DecoderStack; None: every layer and
    the final norm) over the query tokens of batch rows `rows` (`lens[i]` consecutive tokens each,
    flattened request after request), attending to and writing the target's KV cache (`target`: a
    step.TargetView). Returns the residual stream after those layers (the normed hidden
    states after all). Tree queries (draft trees) give the slots' positions (`kv_positions`) and
    their ancestor mask (`tree_mask`). `aux_layers` (every layer only): (normed, the streams entering
    those layers), DecoderStack.run_all. `window` (sink, recent): attend to that part of the context
    only (step.windowed_block_table)."""
    from vllm_sparsever.compat.forward_context import query_forward_context
    from vllm_sparsever.forward_scope import tree_attention

    names = stack.attention_layer_names if num_layers is None else stack.attention_layer_names[:num_layers]
    rows = rows if isinstance(rows, torch.Tensor) else torch.tensor(rows, dtype=torch.long)
    metadata, slots = target.attention_context(names, rows, positions, lens, kv_positions=kv_positions,
                                               block_table=block_table, window=window)
    with query_forward_context(metadata, target.vllm_config, int(tokens.numel()), slots), tree_attention(tree_mask):
        if num_layers is None:
            return stack.run_all(tokens, positions, aux_layers)
        return stack.run_layers(num_layers, tokens, positions)


def final_hidden(target: Any, stack: Any, rows: list[int], tokens: torch.Tensor, positions: torch.Tensor,
                 lens: list[int], **query: Any) -> torch.Tensor:
    """Every layer of `stack` and its final norm over the query tokens (`run_query`)."""
    return run_query(target, stack, rows, tokens, positions, lens, **query)
