"""The verify-cost measurement, run inside a target worker (`vllm-sparsever profile-verify`).

Each grid point is one synthetic verify step: `rows` requests of `context` tokens each, whose K/V
sit in the first blocks of the KV cache (whatever those hold: the time does not depend on the
values), plus `query_tokens` new tokens per row, run through every layer with their logits, as a
verify step runs them. "tree": under a tree mask (a binary tree; sparsever's kernel), "chain":
causally, as a verify step (the kernel `attention.dense_kernel` gives verify steps; one query token:
a decode step, on the kernel `attention.decode_kernel` gives them). On MoE targets every point runs
twice, with random tokens and with one token repeated, and records the share of routed expert
weights the routers picked (the profile tells the experts' cost from the tokens' that way;
adaptive/cost.py). Only a dedicated engine with no requests may run it: it writes K/V into blocks
it does not own.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

import torch

from vllm_sparsever.adaptive.cost import Measurement

logger = logging.getLogger("vllm_sparsever")


def measure_on_worker(worker: Any, grid: list, repeats: int) -> list[dict[str, Any]]:
    """`collective_rpc("sparsever_call", args=(MEASURE_ON_WORKER, grid, repeats))` runs this in every
    worker: synthetic verify steps timed on a dedicated engine with no requests (it writes K/V into
    blocks no request owns)."""
    return measure_verify_cost(worker.model_runner, [tuple(p) for p in grid], repeats)


MEASURE_ON_WORKER = f"{__name__}:measure_on_worker"


def op_profile_on_worker(worker: Any, grid: list, repeats: int, rows: int = 40) -> list[dict[str, Any]]:
    """As `measure_on_worker`, one grid point at a time under torch's profiler: per point, the ops
    that took the most CPU time in its chain steps (name, calls, total ms per step), for finding what
    a verify step spends beyond attention (bench/verify_step.py --op-profile)."""
    from torch.profiler import ProfilerActivity, profile

    out = []
    for point in grid:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            measure_verify_cost(worker.model_runner, [tuple(point)], repeats, masks=("chain",))
        steps = repeats + 1  # (the first warms up)
        ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:rows]
        out.append({"point": list(point), "ops": [
            {"name": e.key, "calls_per_step": e.count / steps, "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps}
            for e in ops]})
    return out


OP_PROFILE_ON_WORKER = f"{__name__}:op_profile_on_worker"


@torch.inference_mode()
def measure_verify_cost(runner: Any, grid: list[tuple[int, int, int]], repeats: int = 3,
                        masks: tuple[str, ...] = ("tree", "chain")) -> list[dict[str, Any]]:
    from vllm_sparsever.drafting.queries import final_hidden
    from vllm_sparsever.compat.model import decoder_stack
    from vllm_sparsever.compat.runner import kv_cache_blocks
    from vllm_sparsever.integration.step_inputs import RunnerTargetView
    from vllm_sparsever.forward_scope import active_plan
    from vllm_sparsever.trees import DraftTopology, stacked_tree_mask

    from vllm_sparsever.compat.cpu_attention import attention_layers
    from vllm_sparsever.verification.sparse.attention import SparseverCPUAttentionImpl
    from vllm_sparsever.verification.lossless.expert_counter import probe_step_experts

    stack = decoder_stack(runner.model)
    target = RunnerTargetView(runner)
    first = attention_layers(runner.vllm_config, stack.attention_layer_names[:1])
    if not all(isinstance(layer.impl, SparseverCPUAttentionImpl) for layer in first.values()):
        raise RuntimeError("profile-verify: the engine runs without sparsever's attention backend (no tree mask)")
    num_blocks, bs = kv_cache_blocks(runner)
    device = runner.device
    vocab = runner.model_config.get_vocab_size()
    gen = torch.Generator().manual_seed(0)
    out = []
    moe = runner.sparsever_runtime.moe_routing is not None
    for point, (rows, q, ctx) in enumerate(_progress(grid), start=1):
        per_row = -(-(ctx + q) // bs)
        if rows * per_row > num_blocks:
            continue  # does not fit this KV cache
        table = torch.arange(rows * per_row, dtype=torch.int32).view(rows, per_row)
        random_tokens = torch.randint(0, vocab, (rows * q,), generator=gen).to(device)
        kv_positions = torch.arange(ctx, ctx + q).repeat(rows).to(device)
        binary = DraftTopology(tuple((i - 1) // 2 for i in range(q)))  # a binary tree of q nodes
        depths = torch.tensor(binary.depths()).repeat(rows).to(device)
        variants = [("random", random_tokens)]
        if moe and rows * q > 1:
            variants.append(("repeated", random_tokens[:1].expand(rows * q).contiguous()))
        for kind, tokens in variants:
            for mask in masks:
                positions = ctx + depths if mask == "tree" else kv_positions
                tree_mask = stacked_tree_mask([binary] * rows).to(device) if mask == "tree" else None
                plan = _verify_step_plan(rows, q, ctx, table, bs) if mask == "chain" else None
                times = []
                for rep in range(repeats + 1):  # the first run warms up
                    with probe_step_experts() as routed, active_plan(plan):
                        start = time.perf_counter()
                        normed = final_hidden(target, stack, list(range(rows)), tokens, positions, [q] * rows,
                                              kv_positions=kv_positions, tree_mask=tree_mask, block_table=table)
                        stack.compute_logits(normed)
                        if rep:
                            times.append(time.perf_counter() - start)
                experts = statistics.fmean(d / e for _, d, e in routed) if routed else 0.0
                out.append(Measurement(mask, rows, q, ctx, statistics.median(times), experts, kind).__dict__)
            times_ms = ", ".join(f"{m['mask']} {1e3 * m['seconds']:.1f} ms" for m in out[-len(masks):])
            logger.info("profile-verify: %d/%d rows=%d tokens=%d context=%d %s: %s%s", point, len(grid), rows, q,
                        ctx, kind, times_ms, f", experts {out[-1]['experts']:.2f}" if moe else "")
    return out


def _progress(grid: list[tuple[int, int, int]]) -> Any:
    """The grid's points, with points done and time left (tqdm, on stderr) on the first
    tensor-parallel rank only."""
    from tqdm import tqdm
    from vllm.distributed import get_tensor_model_parallel_rank

    return tqdm(grid, desc="profile-verify", unit="point", mininterval=1.0,
                disable=get_tensor_model_parallel_rank() != 0)


def _verify_step_plan(rows: int, q: int, ctx: int, table: torch.Tensor, block_size: int):
    """The plan of a dense verify step of `rows` requests with q - 1 drafts each after `ctx` tokens
    (no verify request for q = 1: a decode step), so attention picks the kernel real steps get."""
    import numpy as np

    from vllm_sparsever.plan import build_verification_plan

    ids = [f"profile-verify-{i}" for i in range(rows)]
    return build_verification_plan(
        step=0, req_ids=ids, num_scheduled_tokens=np.full(rows, q), num_computed_tokens=np.full(rows, ctx),
        scheduled_spec_decode_tokens={i: [0] * (q - 1) for i in ids}, block_table=table,
        block_size=block_size, sparsify=False)
