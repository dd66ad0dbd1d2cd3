"""Runs inside the worker for bench/draft_pass.py (through `sparsever_call`): times every draft pass of
the draft-model drafter, split into its parts, profiles a few passes op by op, and measures the
worker's memory bandwidth with its own threads."""

from __future__ import annotations

import time
from typing import Any

import torch

from vllm_sparsever.drafting import draft_model

PASSES: list[dict[str, Any]] = []
OPS: dict[str, list[float]] = {}  # op name -> [self CPU us, calls] over the profiled passes
_STATE: dict[str, Any] = {"profile": 0, "profiled": 0, "profiled_s": 0.0, "parts": {}}


def _drafter(worker: Any) -> Any:
    proposer = worker.model_runner.sparsever_proposer
    return getattr(proposer, "drafter", proposer)


# --split-layers: a decoder layer's modules timed by kind (the rest of "layers" is the layers' own Python)
# (kind, class-name suffix): vLLM's `Attention` layer, not the model's `Qwen2Attention` around it
LAYER_KINDS = (("linear", "Linear"), ("attention", "Attention"), ("rotary", "RotaryEmbedding"),
               ("norm", "RMSNorm"), ("activation", "SiluAndMul"))


def _layer_kind(module: Any) -> str | None:
    name = type(module).__name__
    for kind, suffix in LAYER_KINDS:
        if name.endswith(suffix) and (kind != "attention" or name == "Attention"):
            return kind
    return None


def install(worker: Any, split_layers: bool = False, lean_ab: bool = False) -> bool:
    """Time every draft pass. `split_layers`: through the layers' modules (their lean calls off), each
    module kind timed; `lean_ab`: passes alternate between the lean layer calls and the modules' (each
    pass records which: "lean")."""
    drafter = _drafter(worker)
    stack, target, parts = drafter._stack, drafter.target, _STATE["parts"]
    lean = stack.lean
    if split_layers:
        object.__setattr__(stack, "lean", None)

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                parts[name] = parts.get(name, 0.0) + time.perf_counter() - start
        return wrapper

    # A pass: the attention metadata of its queries, the decoder layers, the LM head (over the draft
    # vocabulary's rows, or the whole one), the prefix-sharing bookkeeping; the rest is Python around them.
    target.attention_context = timed("metadata", target.attention_context)
    object.__setattr__(stack, "run_all", timed("layers", stack.run_all))  # (a frozen dataclass)
    if drafter._vocab is not None:
        drafter._vocab.argmax = timed("head", drafter._vocab.argmax)
        drafter._vocab.top = timed("head", drafter._vocab.top)
    else:
        object.__setattr__(stack, "compute_logits", timed("head", stack.compute_logits))
    drafter._writing = timed("bookkeeping", drafter._writing)
    if split_layers:  # each module's forward timed where the layer calls it (outermost match only; once
        # per module: layers may share one, as vLLM's cached rotary embedding)
        seen: set[int] = set()
        for layer in stack.layers:
            for _, module in layer.named_modules():
                kind = _layer_kind(module)
                if kind is None or any(id(m) in seen for m in module.modules()):
                    continue
                seen.update(id(m) for m in module.modules())
                module.forward = timed(f"layer_{kind}", module.forward)
    shape: dict[str, int] = {}
    run = draft_model.final_hidden

    def final_hidden(target: Any, stack: Any, rows: Any, tokens: torch.Tensor, positions: torch.Tensor,
                     lens: list[int], **query: Any) -> torch.Tensor:
        shape["rows"] = max(shape.get("rows", 0), len(rows))
        shape["tokens"] = shape.get("tokens", 0) + int(tokens.numel())
        shape["context"] = max(shape.get("context", 0), int(positions.max()) + 1)
        return run(target, stack, rows, tokens, positions, lens, **query)

    draft_model.final_hidden = final_hidden

    def timed_pass(fn: Any) -> Any:
        """One pass (chains: `_predict`; trees and EVICT's chains: the root's catch-up pass, then a
        level's pass), timed whole, or profiled op by op."""
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            parts.clear()
            shape.clear()
            start = time.perf_counter()
            if _STATE["profiled"] < _STATE["profile"]:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    out = fn(*args, **kwargs)
                _STATE["profiled"] += 1
                _STATE["profiled_s"] += time.perf_counter() - start
                for e in prof.key_averages():
                    acc = OPS.setdefault(e.key, [0.0, 0])
                    acc[0] += e.self_cpu_time_total
                    acc[1] += e.count
                return out
            out = fn(*args, **kwargs)
            PASSES.append({**shape, "total_s": time.perf_counter() - start, **parts,
                           **({"lean": stack.lean is not None} if lean_ab else {})})
            if lean_ab:  # the next pass the other way
                object.__setattr__(stack, "lean", None if stack.lean is not None else lean)
            return out
        return wrapper

    for name in ("_predict", "_tree_root_top", "_tree_level_top"):
        setattr(drafter, name, timed_pass(getattr(drafter, name)))
    return True


def profile(worker: Any, passes: int) -> bool:
    """Profile the next `passes` draft passes op by op (kept out of the timed ones)."""
    _STATE["profile"], _STATE["profiled"], _STATE["profiled_s"] = passes, 0, 0.0
    OPS.clear()
    return True


def fetch(worker: Any) -> dict[str, Any]:
    out = {"passes": list(PASSES), "ops": {k: list(v) for k, v in OPS.items()},
           "profiled_passes": _STATE["profiled"], "profiled_s": _STATE["profiled_s"]}
    PASSES.clear()
    return out


def bandwidth(worker: Any, megabytes: int = 512, repeats: int = 5) -> dict[str, Any]:
    """The worker's copy bandwidth (bytes read + written per second, best of `repeats`) over buffers
    far larger than the caches, with the worker's torch threads."""
    src = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return {"copy_GBps": 2 * src.numel() * 4 / best / 1e9, "threads": torch.get_num_threads(), "megabytes": megabytes}


def pass_bytes(worker: Any) -> dict[str, Any]:
    """What one draft pass must read, from the draft's config (drafting.draft_model's price): the
    projections at their stored bits, the LM head rows it multiplies, and per context token the K/V
    of every layer."""
    from vllm_sparsever.drafting.draft_model import _dtype_bits, _token_weights, _weight_bits

    drafter = _drafter(worker)
    model = drafter.target.draft_model()
    config = model.config
    projections, head = _token_weights(config)
    bits = _dtype_bits(model)
    dtype_bytes = bits // 8
    vocab = drafter._vocab
    head_rows = vocab.num_tokens if vocab is not None else int(config.vocab_size)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    window = drafter._window
    return {
        "projection_bytes": projections * _weight_bits(config, bits) / 8,
        "head_bytes": head_rows * int(config.hidden_size) * (drafter.head_bits or bits) // 8,
        "head_rows": head_rows,
        "kv_bytes_per_token": int(config.num_hidden_layers) * 2 * kv_heads * head_dim * dtype_bytes,
        "attention_window": None if window is None else sum(window),
        "torch_threads": torch.get_num_threads(),
    }
