"""vLLM's V1 model runner: the hooks the sparsever mixin overrides and the per-step state it reads.

Private symbols touched:
- runner methods overridden by `SparseverRunnerMixin` (table `RUNNER_HOOKS`): `load_model`,
  `execute_model`, `_prepare_inputs`, `_model_forward`, `_sample`, `propose_draft_token_ids`,
  `sample_tokens` of `GPUModelRunner` / `CPUModelRunner`;
- `runner.use_async_scheduling` (`async_scheduling`: a proposer that proposes late needs it off);
- `runner.input_batch` (`InputBatch`): `req_ids`, `num_reqs`, `num_computed_tokens_cpu`,
  `block_table[0]` (KV cache group 0) with `.get_cpu_tensor()` and `.block_size`;
- `SchedulerOutput.scheduled_spec_decode_tokens` (req id -> draft tokens being verified),
  `SchedulerOutput.finished_req_ids` (per-request state to drop) and
  `SchedulerOutput.scheduled_new_reqs` (`NewRequestData.req_id`, `.prompt_token_ids`,
  `.num_computed_tokens`: what the prefix cache supplied when the request was scheduled);
- `ModelRunnerOutput.sampled_token_ids` / `.req_id_to_index` (absent on `AsyncModelRunnerOutput`);
- the proposers' step input (`committed_tokens`, `allocated_slots`, `request_limits`, from which
  integration/step_inputs.py builds `step.DraftStep`): `input_batch.num_tokens_no_spec`,
  `.token_ids_cpu`, `.block_table.block_tables` (`num_blocks_per_row`, `block_size`) and
  `runner.requests` (below);
- the target's end-of-sequence tokens (`eos_token_ids`): `ModelConfig.hf_text_config.eos_token_id`
  and `ModelConfig.try_get_generation_config()`;
- `runner.drafter.load_model` (the draft model's load, after the target's): replaced on the
  instance by `intercept_drafter_load`;
- self-drafting (`query_attention_context`): `runner.attn_groups` (`AttentionGroup.layer_names`,
  `.kv_cache_group_id`, `.kernel_block_size`, `.get_metadata_builder()`), the builder's
  `build(common_prefix_len, common_attn_metadata)`, `CommonAttentionMetadata`'s fields,
  `input_batch.block_table[g]` (`get_cpu_tensor`, `block_size`, `num_blocks_per_row`; also
  `layers_block_table`: the draft model's blocks, whose K/V a prefix-cache hit may reuse),
  `input_batch.num_tokens_no_spec`, and `set_forward_context(..., slot_mapping=)` (per-layer slot
  mapping read by the attention layers' KV-cache write);
- hierarchical verification: `runner.drafter.model` (the draft model vLLM's `draft_model` method
  loaded, run by sparsever's drafter in rounds), `runner._draft_token_ids` /
  `._draft_token_req_ids` (the step's drafts `take_draft_token_ids` returns; a list of lists is
  returned as it is, with the batch's request ids), `input_batch.token_ids_cpu` (prompt + output tokens per row, for
  prompt lookup over pending tokens) and `runner.requests[req_id]` (`CachedRequestState`:
  `sampling_params.max_tokens`, `.stop_token_ids`, `.all_stop_token_ids`, `.ignore_eos`,
  `num_prompt_tokens`), to stop a request's rounds at its stop tokens and `max_tokens`; the
  scheduled drafts in `token_ids_cpu` (written by `_update_states`) to check reused streams;
- draft trees: `_sample(logits, spec_decode_metadata)`'s arguments, `SpecDecodeMetadata.
  cu_num_sampled_tokens`, `input_batch.sampling_metadata` (`all_greedy`, `temperature`, `top_k`,
  `top_p`, `generators`), `SamplerOutput.sampled_token_ids`, `requests[..].sampling_params` fields
  (`SAMPLER_ONLY_PARAMS`), `vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p`,
  `Attention.kv_cache` (bound at KV cache set-up) with `attn_groups`, `runner.kv_caches`; and the
  extra `kv_positions` / `block_table` of `query_attention_context`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_sparsever.compat import check_signature

# Hooks the mixin overrides -> the parameters (after self) it passes positionally and so relies on;
# () = the mixin forwards *args/**kwargs unchanged, so the hook only has to exist.
RUNNER_HOOKS: dict[str, tuple[str, ...]] = {
    "load_model": (),
    "execute_model": ("scheduler_output", "intermediate_tensors"),
    "_prepare_inputs": ("scheduler_output", "num_scheduled_tokens"),
    "_model_forward": (),
    "_sample": (),
    "propose_draft_token_ids": ("scheduler_output", "sampled_token_ids"),
    "sample_tokens": ("grammar_output",),
}

# Attributes of the runner's InputBatch read each step.
INPUT_BATCH_ATTRIBUTES = ("req_ids", "num_reqs", "num_computed_tokens_cpu", "block_table")


def check_runner_hooks(base_cls: type) -> None:
    """Raise RuntimeError if `base_cls` lacks a hook of `RUNNER_HOOKS` or its parameters changed."""
    problems = [p for name, params in RUNNER_HOOKS.items() if (p := check_signature(base_cls, name, params))]
    if problems:
        raise RuntimeError(
            "vllm-sparsever cannot drive this vLLM model runner: " + "; ".join(problems)
            + " (see docs/compat.md)"
        )


@dataclass(frozen=True)
class BatchView:
    """What a step's plan needs from the runner's InputBatch (rows 0..num_reqs-1 are live)."""

    req_ids: list[str]
    num_reqs: int
    num_computed_tokens: np.ndarray  # [max_num_reqs] (CPU, vLLM's buffer: read, do not keep)
    block_table_cpu: Any  # torch.Tensor [max_num_reqs, max_blocks], KV cache group 0
    block_size: int


def input_batch_view(runner: Any) -> BatchView:
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    block_table = batch.block_table[0]
    return BatchView(
        req_ids=list(batch.req_ids[:num_reqs]),
        num_reqs=num_reqs,
        num_computed_tokens=batch.num_computed_tokens_cpu,
        block_table_cpu=block_table.get_cpu_tensor(),
        block_size=int(block_table.block_size),
    )


def async_scheduling(runner: Any) -> bool:
    """Whether the engine schedules asynchronously (`runner.use_async_scheduling`)."""
    return bool(getattr(runner, "use_async_scheduling", False))


def batch_num_rows(runner: Any) -> int:
    """Rows of the runner's batch (`runner.input_batch.num_reqs`)."""
    return runner.input_batch.num_reqs


def finished_request_ids(scheduler_output: Any) -> set[str]:
    """Requests that finished (or were aborted) since the last step: workers drop their state.
    The scheduler sends them once more after the last request ends, in a step with no work."""
    return scheduler_output.finished_req_ids


def prompt_tokens_to_compute(scheduler_output: Any) -> dict[str, int]:
    """Per request scheduled for the first time (new, or resumed after preemption), the prompt tokens
    the target computes for it: its prompt less the tokens vLLM's prefix cache supplied."""
    return {new.req_id: max(len(new.prompt_token_ids or ()) - int(new.num_computed_tokens), 0)
            for new in scheduler_output.scheduled_new_reqs}


def scheduled_drafts(scheduler_output: Any) -> dict[str, list[int]]:
    """Draft tokens being verified this step, per request id (requests without drafts absent)."""
    return scheduler_output.scheduled_spec_decode_tokens


def sampled_tokens(output: Any) -> tuple[dict[str, int], list[list[int]]] | None:
    """(req_id_to_index, sampled token ids per row) of a runner output; None when the tokens are not
    available here (async output, or no output)."""
    sampled = getattr(output, "sampled_token_ids", None)
    index = getattr(output, "req_id_to_index", None)
    if sampled is None or index is None:
        return None
    return index, sampled


def intercept_drafter_load(runner: Any, before_load: Callable[[], None],
                           during_load: Callable[[], Any] | None = None) -> Callable[[], None]:
    """Call `before_load()` right before the runner's drafter loads its model (once), and load it
    inside the context manager `during_load()` returns, if given.

    Returns an undo callable restoring the drafter's own `load_model`; a no-op when the runner has
    no drafter (n-gram drafting has `load_model` too; a runner without spec decode has none)."""
    drafter = getattr(runner, "drafter", None)
    if drafter is None or not hasattr(drafter, "load_model"):
        return lambda: None
    had_instance_attr = "load_model" in getattr(drafter, "__dict__", {})
    original = drafter.load_model

    def load_model(*args: Any, **kwargs: Any) -> Any:
        before_load()
        with during_load() if during_load is not None else contextlib.nullcontext():
            return original(*args, **kwargs)

    drafter.load_model = load_model

    def undo() -> None:
        if getattr(drafter, "load_model", None) is not load_model:
            return  # already restored (or replaced by someone else: leave theirs)
        if had_instance_attr:
            drafter.load_model = original
        else:
            del drafter.load_model  # back to the class's method

    return undo


def draft_model(runner: Any) -> Any:
    """The draft model vLLM loaded for its `draft_model` method (ValueError without one)."""
    model = getattr(getattr(runner, "drafter", None), "model", None)
    if model is None:
        raise ValueError("the runner has no loaded draft model (speculative method 'draft_model' expected)")
    return model


def scheduled_token_ids(runner: Any, row: int, start: int, n: int) -> list[int]:
    """The `n` token ids batch row `row` runs this step from position `start` (its committed tokens
    and the drafts vLLM wrote after them when it scheduled them)."""
    return runner.input_batch.token_ids_cpu[row, start: start + n].tolist()


def step_token_layout(runner: Any, num_scheduled_tokens: np.ndarray) -> list[tuple[str, int, list[int]]]:
    """Per batch row, in the order the step's tokens are laid out: (request id, the position of its
    first scheduled token, the scheduled token ids). Read in `_prepare_inputs`, before bookkeeping."""
    batch = runner.input_batch
    out = []
    for row in range(batch.num_reqs):
        n = int(num_scheduled_tokens[row])
        start = int(batch.num_computed_tokens_cpu[row])
        out.append((batch.req_ids[row], start, scheduled_token_ids(runner, row, start, n)))
    return out


def set_draft_token_ids(runner: Any, drafts: list[list[int]]) -> None:
    """Make `drafts` (per batch row) the drafts `take_draft_token_ids()` hands the scheduler for
    this step, replacing what the runner's own proposal left there. vLLM's `draft_model` method
    proposes before the step's bookkeeping (from device tensors); sparsever's draft-model drafter
    needs the committed tokens, so it proposes after `sample_tokens` and sets its drafts here."""
    runner._draft_token_ids = drafts
    runner._draft_token_req_ids = list(runner.input_batch.req_ids)


def request_limits(runner: Any, rows: Iterable[int]) -> list[tuple[frozenset[int], int | None]]:
    """Per batch row of `rows`: (its stop tokens, EOS included unless ignore_eos; its remaining
    max_tokens, counted from the tokens committed so far, the one sampled this step included; None
    without max_tokens)."""
    batch = runner.input_batch
    out = []
    for row in rows:
        state = runner.requests[batch.req_ids[row]]
        params = state.sampling_params
        if params is None:  # pooling request: nothing to stop on
            out.append((frozenset(), None))
            continue
        stops = params.all_stop_token_ids if not params.ignore_eos else set(params.stop_token_ids or ())
        remaining = None
        if params.max_tokens is not None:
            emitted = int(batch.num_tokens_no_spec[row]) - int(state.num_prompt_tokens)
            remaining = int(params.max_tokens) - emitted
        out.append((frozenset(int(t) for t in stops), remaining))
    return out


def allocated_slots(runner: Any) -> np.ndarray:
    """Per batch row, the KV slots allocated to the request (in every KV cache group): positions
    below this may be written."""
    batch = runner.input_batch
    n = batch.num_reqs
    slots = None
    for table in batch.block_table.block_tables:
        group = table.num_blocks_per_row[:n].astype(np.int64) * int(table.block_size)
        slots = group if slots is None else np.minimum(slots, group)
    return slots


def committed_tokens(runner: Any) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The batch after the step's bookkeeping: (request ids per row, each row's token count: prompt +
    accepted output, drafts excluded, views of `input_batch.num_tokens_no_spec`; the rows' tokens
    [max_num_reqs, max_model_len], `input_batch.token_ids_cpu`). Views of vLLM's buffers: read them
    within the step."""
    batch = runner.input_batch
    n = batch.num_reqs
    return list(batch.req_ids[:n]), batch.num_tokens_no_spec[:n], batch.token_ids_cpu


def eos_token_ids(model_config: Any) -> set[int]:
    """The target's end-of-sequence tokens: `ModelConfig.hf_text_config.eos_token_id` and
    `try_get_generation_config()["eos_token_id"]` (an int or a list each)."""
    ids: set[int] = set()
    for value in (getattr(model_config.hf_text_config, "eos_token_id", None),
                  model_config.try_get_generation_config().get("eos_token_id")):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def query_attention_context(
    runner: Any, layer_names: list[str], rows: torch.Tensor, positions: torch.Tensor, query_lens: list[int],
    kv_positions: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
    read_window: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
    | None = None,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Attention metadata and slot mapping for `query_lens[i]` consecutive query tokens of batch
    row `rows[i]`, whose positions are `positions` (flattened, request after request), each token
    attending causally to the request's KV up to its own position (its K/V written first). Returns
    (per-layer metadata, per-layer slot mapping) for `layer_names`, for `set_forward_context`.
    `kv_positions`: where the tokens' K/V go when that differs from their rotary positions (tree
    tokens: context length + query index, their positions being context length + depth).
    `block_table` [rows, blocks] (CPU int32): rows index it instead of the batch's block tables
    (synthetic requests: the verify-cost profiler, offline/profile_verify.py).
    `read_window(block table [rows, blocks], sequence lengths, first query positions, block size)`:
    the (block table, sequence lengths) the queries read through instead (a sliding window such as
    `step.windowed_block_table`'s); K/V are written where they belong.
    """
    from vllm.v1.attention.backend import CommonAttentionMetadata

    wanted = set(layer_names)
    per_layer: dict[str, Any] = {}
    slots: dict[str, torch.Tensor] = {}
    num_reqs = int(rows.numel())
    num_tokens = int(positions.numel())
    lens = torch.tensor(query_lens, dtype=torch.long)
    token_rows = rows.cpu().long().repeat_interleave(lens)
    pos_cpu = (positions if kv_positions is None else kv_positions).cpu().long()
    query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(lens, 0).to(torch.int32)
    seq_lens = (pos_cpu[query_start_loc[1:].long() - 1] + 1).to(torch.int32)  # last position + 1
    device = positions.device
    for groups in runner.attn_groups:
        for group in groups:
            names = wanted.intersection(group.layer_names)
            if not names:
                continue
            if group.kernel_block_size is not None:
                raise NotImplementedError(
                    "self-drafting: attention groups with kernel blocks smaller than the KV cache's "
                    "blocks are not supported"
                )
            table = runner.input_batch.block_table[group.kv_cache_group_id]
            bs = int(table.block_size)
            table_cpu = table.get_cpu_tensor() if block_table is None else block_table
            block = table_cpu[token_rows, pos_cpu // bs].long()
            slot = block * bs + pos_cpu % bs
            read_table, read_lens = table_cpu[rows.cpu().long()], seq_lens
            if read_window is not None:
                firsts = pos_cpu[query_start_loc[:-1].long()]
                read_table, read_lens = read_window(read_table, seq_lens, firsts, bs)
            common = CommonAttentionMetadata(
                query_start_loc=query_start_loc.to(device),
                query_start_loc_cpu=query_start_loc,
                seq_lens=read_lens.to(device),
                num_reqs=num_reqs,
                num_actual_tokens=num_tokens,
                max_query_len=int(lens.max()),
                max_seq_len=int(read_lens.max()),
                block_table_tensor=read_table.to(device),
                slot_mapping=slot.to(device),
                causal=True,
                positions=positions,
                seq_lens_cpu_upper_bound=read_lens,
            )
            metadata = group.get_metadata_builder().build(common_prefix_len=0, common_attn_metadata=common)
            for name in names:
                per_layer[name] = metadata
                slots[name] = common.slot_mapping
            wanted -= names
    if wanted:
        raise ValueError(f"attention layers not in the runner's attention groups: {sorted(wanted)}")
    return per_layer, slots


def layers_block_table(runner: Any, layer_names: list[str]) -> tuple[torch.Tensor, int] | None:
    """(block table [rows, blocks] on the CPU, block size) of the KV cache group that holds every
    layer of `layer_names`; None where they span several groups."""
    wanted = set(layer_names)
    for groups in runner.attn_groups:
        for group in groups:
            if wanted <= set(group.layer_names):
                table = runner.input_batch.block_table[group.kv_cache_group_id]
                return table.get_cpu_tensor(), int(table.block_size)
    return None


@dataclass(frozen=True)
class LayerKV:
    """One attention layer's KV cache tensor, its layer object (for its attention impl) and the
    block table (CPU, per batch row) and block size of its KV cache group."""

    name: str
    layer: Any
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    block_size: int


def layer_kv_caches(runner: Any, layer_names: list[str]) -> list[LayerKV]:
    """The KV caches of `layer_names` (`Attention.kv_cache`, bound at KV cache set-up) with their
    group's block table."""
    from vllm_sparsever.compat.cpu_attention import attention_layers

    layers = attention_layers(runner.vllm_config, layer_names)
    out = []
    for groups in runner.attn_groups:
        for group in groups:
            table = runner.input_batch.block_table[group.kv_cache_group_id]
            for name in layer_names:
                if name in group.layer_names:
                    kv = layers[name].kv_cache
                    kv = kv[0] if isinstance(kv, (list, tuple)) else kv
                    out.append(LayerKV(name, layers[name], kv, table.get_cpu_tensor(), int(table.block_size)))
    if len(out) != len(layer_names):
        raise ValueError(f"KV caches found for {len(out)} of {len(layer_names)} attention layers")
    return out


# SamplingParams fields whose effect vLLM's rejection sampler (or its logits processors; for min_p
# and logit_bias sparsever's wrapper around them, compat/sampling.py) applies to the target's
# logits, with their "no effect" value: a request with any other value is verified by
# vLLM's sampler, so sparsever drafts it a chain, never a tree (verification/lossless/tree_acceptance.py acceptance
# applies temperature, top-k and top-p only).
SAMPLER_ONLY_PARAMS: dict[str, Any] = {
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0,
    "min_tokens": 0, "logprobs": None, "logprob_token_ids": None, "logit_bias": None,
    "allowed_token_ids": None, "bad_words": None, "structured_outputs": None, "watermarking": False,
    "thinking_token_budget": None,
}


def batch_sampling_params(runner: Any) -> list[Any]:
    """The batch's SamplingParams in batch order (`runner.input_batch.req_ids` ->
    `runner.requests[req_id].sampling_params`; None for a request without them)."""
    requests = runner.requests
    return [getattr(requests.get(req_id), "sampling_params", None) for req_id in runner.input_batch.req_ids]


def row_sampling_params(runner: Any, row: int) -> Any:
    """Batch row `row`'s SamplingParams (`runner.requests[input_batch.req_ids[row]]`; None without)."""
    return runner.requests[runner.input_batch.req_ids[row]].sampling_params


def tree_sampling_supported(runner: Any, row: int) -> bool:
    """Whether batch row `row`'s sampling is plain enough for tree acceptance (temperature, top-k,
    top-p, seed): `runner.requests[req_id].sampling_params` against `SAMPLER_ONLY_PARAMS`."""
    params = row_sampling_params(runner, row)
    if params is None:
        return False
    for name, default in SAMPLER_ONLY_PARAMS.items():
        value = getattr(params, name, default)
        if not (value is None or value == default or (isinstance(value, (list, dict)) and not value)):
            return False
    return True


def seeded_sampling(runner: Any, row: int) -> bool:
    """Whether batch row `row` samples with a seed (`SamplingParams.sampling_type` RANDOM_SEED): its
    random draws per step follow its drafts' shape, so that shape must depend on the request alone
    for the same seed to give the same text."""
    from vllm.sampling_params import SamplingType

    params = row_sampling_params(runner, row)
    return params is not None and params.sampling_type == SamplingType.RANDOM_SEED


def processed_target_probs(logits: torch.Tensor, temperature: float, top_k: Any, top_p: Any) -> torch.Tensor:
    """The target's sampling distribution from its logits [n, V], as vLLM's sampler forms it:
    divided by the temperature, then vLLM's own top-k/top-p mask (`apply_top_k_top_p`)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    scaled = logits.float() / temperature
    n = scaled.shape[0]
    k = None if top_k is None else top_k.expand(n).to(torch.long)
    p = None if top_p is None else top_p.expand(n).to(scaled.dtype)
    return torch.softmax(apply_top_k_top_p(scaled, k, p), dim=-1)


def kv_cache_blocks(runner: Any) -> tuple[int, int]:
    """(blocks in the KV cache, block size) of KV cache group 0 (`runner.kv_caches`)."""
    return int(runner.kv_caches[0].shape[0]), int(runner.input_batch.block_table[0].block_size)


# ---- tree verification: the step's sampling inputs and outputs --------------------------------


def sample_call_args(args: tuple, kwargs: dict) -> tuple[torch.Tensor, Any]:
    """(logits, spec_decode_metadata) of a `_sample(logits, spec_decode_metadata)` call."""
    logits = kwargs["logits"] if "logits" in kwargs else args[0]
    metadata = kwargs["spec_decode_metadata"] if "spec_decode_metadata" in kwargs else args[1]
    return logits, metadata


def logits_row_ends(metadata: Any) -> list[int]:
    """Per batch row, the end of its logits rows in `_sample`'s logits (`SpecDecodeMetadata.
    cu_num_sampled_tokens`: drafts + 1 rows per request, in batch order)."""
    return metadata.cu_num_sampled_tokens.tolist()


@dataclass(frozen=True)
class RowSampling:
    """How batch row r samples: temperature None = greedy; top_k/top_p [1] tensors or None."""

    temperature: float | None
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    generator: torch.Generator | None


def row_sampling(runner: Any, row: int) -> RowSampling:
    """From `input_batch.sampling_metadata` (`all_greedy`, `temperature`, `top_k`, `top_p`,
    `generators`); vLLM marks greedy rows with temperature 0 (below its _SAMPLING_EPS)."""
    sm = runner.input_batch.sampling_metadata
    temperature = None if sm.all_greedy or sm.temperature is None else float(sm.temperature[row])
    if temperature is not None and temperature < 1e-5:
        temperature = None
    pick = lambda t: None if t is None else t[row: row + 1]  # noqa: E731
    return RowSampling(temperature, pick(sm.top_k), pick(sm.top_p), sm.generators.get(row))


def write_sampled_tokens(output: Any, row: int, tokens: list[int]) -> None:
    """Make batch row `row` of a `SamplerOutput` emit `tokens` (its `sampled_token_ids` [B, S],
    -1 = no token)."""
    sampled = output.sampled_token_ids
    sampled[row].fill_(-1)
    sampled[row, : len(tokens)] = torch.tensor(tokens, dtype=sampled.dtype)


def emitted_count(output: Any, row: int) -> int:
    """How many tokens batch row `row` of a `SamplerOutput` emits (entries other than -1)."""
    return int((output.sampled_token_ids[row] != -1).sum())
