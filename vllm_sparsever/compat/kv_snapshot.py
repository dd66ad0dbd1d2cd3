"""A prompt's KV cache kept on disk and loaded by later engines: long-context benchmarks prefill once.

The benchmark harness (`bench/harness.py --kv-snapshot DIR`) compares a dozen engines over the same
long prompts, one engine at a time. At 32K tokens an engine's prefill takes far longer than its decode,
so such a run spent nearly all its time prefilling the same text again. With this
connector one engine prefills and saves each prompt's KV blocks (every attention layer: the target's
and a draft model's); every later engine loads them instead of prefilling, then decodes over the same
K/V. Decode-only timings are what such a run reports.

The copy is block-granular: whole KV blocks of the prompt (the blocks before its last token), each layer's
`[num_blocks, ...]` cache indexed by block id. Within a block the CPU backend packs K and V per its ISA
(K transposed for `vec`/`vec16`, tiles for AMX), so a snapshot is tied to the layout that wrote it:
the same block size, cache dtype, layer shapes and machine class. The key hashes the target model, its
dtype and cache dtype, the block sizes, the CPU class the harness names and the prompt's tokens; the
per-layer shapes are checked on load.

Not a serving feature: vLLM loads it for an engine whose `kv_transfer_config` names this module
(`kv_snapshot_transfer_config`); the plugin's own code never uses it.

Private symbols touched (vLLM's KV connector API, marked experimental upstream):
- base `vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorBase_V1` with `KVConnectorRole`,
  `KVConnectorMetadata`; its `__init__(vllm_config, role, kv_cache_config)`, `_get_connector_metadata()`
  and the methods overridden below, called by vLLM's scheduler and model runner;
- `KVTransferConfig` fields `kv_connector`, `kv_connector_module_path`, `kv_role`,
  `kv_connector_extra_config` and `get_from_extra_config`;
- the scheduler's `Request.prompt_token_ids` / `request_id`, `SchedulerOutput.scheduled_new_reqs`
  (`req_id`, `prompt_token_ids`, `block_ids`) and `scheduled_cached_reqs` (`req_ids`,
  `resumed_req_ids`, `new_block_ids`, `num_computed_tokens`);
- `KVCacheConfig.kv_cache_groups[*].layer_names` / `.kv_cache_spec.block_size`;
- `ForwardContext.no_compile_layers` and attention layers' `kv_cache` tensor, blocks first.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

CONNECTOR_NAME = "PromptKVSnapshotConnector"
# KVConnectorBase_V1's methods this connector overrides, with the parameters vLLM calls them with.
CONNECTOR_HOOKS: dict[str, tuple[str, ...]] = {
    "__init__": ("vllm_config", "role", "kv_cache_config"),
    "get_num_new_matched_tokens": ("request", "num_computed_tokens"),
    "update_state_after_alloc": ("request", "blocks", "num_external_tokens"),
    "build_connector_meta": ("scheduler_output",),
    "start_load_kv": ("forward_context",),
    "wait_for_layer_load": ("layer_name",),
    "save_kv_layer": ("layer_name", "kv_layer", "attn_metadata"),
    "wait_for_save": (),
}
MANIFEST = "manifest.json"
TENSORS = "kv.safetensors"


def kv_snapshot_transfer_config(path: str | os.PathLike, *, save: bool, machine: str = "") -> dict[str, Any]:
    """The `kv_transfer_config` an engine takes to load prompt snapshots from `path` and, with `save`,
    to write the ones it lacks (after a prompt's first output token: make it with max_tokens >= 2).
    `machine` (a CPU class) joins the key: the blocks' inner layout follows the machine's ISA."""
    return {"kv_connector": CONNECTOR_NAME, "kv_connector_module_path": __name__, "kv_role": "kv_both",
            "kv_connector_extra_config": {"path": str(path), "save": bool(save), "machine": machine}}


@dataclass
class _Copy:
    key: str
    block_ids: list[list[int]]  # per KV cache group, the blocks to copy, in token order
    first_block: list[int]  # per group, the first block to copy (earlier ones: already in the engine's cache)


@dataclass
class SnapshotMetadata(KVConnectorMetadata):
    loads: list[_Copy] = field(default_factory=list)
    saves: list[_Copy] = field(default_factory=list)


@dataclass
class _Pending:
    key: str
    tokens: int  # prompt tokens
    block_ids: list[list[int]]


class PromptKVSnapshotConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config = self._kv_transfer_config
        path = config.get_from_extra_config("path", None)
        if not path:
            raise ValueError(f"{CONNECTOR_NAME}: kv_connector_extra_config.path (the snapshot directory) is required")
        self._root = Path(path)
        self._save = bool(config.get_from_extra_config("save", False))
        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
        if not groups:
            raise ValueError(f"{CONNECTOR_NAME}: needs the engine's KV cache groups (vLLM passed none)")
        self._group_block_sizes = [int(g.kv_cache_spec.block_size) for g in groups]
        self._layer_group = {name: i for i, g in enumerate(groups) for name in g.layer_names}
        # Whole blocks of every group: the copied prefix is a multiple of each group's block size.
        self._align = math.lcm(*self._group_block_sizes)
        model = vllm_config.model_config
        self._identity = json.dumps({"model": str(model.model), "dtype": str(model.dtype),
                                     "machine": str(config.get_from_extra_config("machine", "")),
                                     "cache_dtype": str(vllm_config.cache_config.cache_dtype),
                                     "block_sizes": self._group_block_sizes}, sort_keys=True)
        # scheduler side
        self._loads: dict[str, tuple[str, int]] = {}  # request id -> (key, tokens already computed locally)
        self._load_tokens: dict[str, int] = {}  # request id -> its prompt's length
        self._pending: dict[str, _Pending] = {}
        self._saving_keys: set[str] = set()

    # ---- keys --------------------------------------------------------------------------------------

    def _copied_tokens(self, prompt_tokens: int) -> int:
        """The prompt tokens a snapshot holds: whole blocks before the last token, which an engine always
        computes (its logits sample the first output token)."""
        return (prompt_tokens - 1) // self._align * self._align

    def _key(self, token_ids: list[int]) -> str:
        n = self._copied_tokens(len(token_ids))
        digest = hashlib.sha256(self._identity.encode())
        digest.update(torch.tensor(token_ids[:n], dtype=torch.int64).numpy().tobytes())
        return digest.hexdigest()[:32]

    def _exists(self, key: str) -> bool:
        return (self._root / key / MANIFEST).exists()

    # ---- scheduler side ----------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        tokens = list(request.prompt_token_ids or [])
        copied = self._copied_tokens(len(tokens))
        if copied <= num_computed_tokens:
            return 0, False
        key = self._key(tokens)
        if not self._exists(key):
            return 0, False
        self._loads[request.request_id] = (key, num_computed_tokens)
        self._load_tokens[request.request_id] = len(tokens)
        return copied - num_computed_tokens, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            self._loads.pop(request.request_id, None)
            self._load_tokens.pop(request.request_id, None)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = SnapshotMetadata()
        for req in scheduler_output.scheduled_new_reqs:
            tokens = list(req.prompt_token_ids or [])
            block_ids = [list(ids) for ids in req.block_ids]
            if req.req_id in self._loads:
                key, computed = self._loads.pop(req.req_id)
                self._load_tokens.pop(req.req_id, None)
                meta.loads.append(self._copy(key, block_ids, len(tokens), computed))
            elif self._save and self._copied_tokens(len(tokens)) > 0:
                key = self._key(tokens)
                if not self._exists(key) and key not in self._saving_keys:
                    self._saving_keys.add(key)
                    self._pending[req.req_id] = _Pending(key, len(tokens), block_ids)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id in self._loads and req_id in cached.resumed_req_ids:
                # Preempted, then scheduled again: its blocks were freed, and a resumed request's
                # new_block_ids are all of its blocks.
                key, computed = self._loads.pop(req_id)
                tokens = self._load_tokens.pop(req_id)
                meta.loads.append(self._copy(key, [list(ids) for ids in cached.new_block_ids[i]], tokens, computed))
                continue
            pending = self._pending.get(req_id)
            if pending is None:
                continue
            if req_id in cached.resumed_req_ids:  # preempted: its blocks were freed, nothing to save
                self._saving_keys.discard(self._pending.pop(req_id).key)
                continue
            new = cached.new_block_ids[i]
            if new is not None:
                for group, ids in zip(pending.block_ids, new, strict=True):
                    group.extend(ids)
            # The prompt and the draft passes over it have run: save before this step writes past it.
            if cached.num_computed_tokens[i] >= pending.tokens:
                del self._pending[req_id]
                meta.saves.append(self._copy(pending.key, pending.block_ids, pending.tokens, 0))
        return meta

    def _copy(self, key: str, block_ids: list[list[int]], prompt_tokens: int, computed: int) -> _Copy:
        copied = self._copied_tokens(prompt_tokens)
        per_group = [ids[:copied // bs] for ids, bs in zip(block_ids, self._group_block_sizes, strict=True)]
        return _Copy(key, per_group, [computed // bs for bs in self._group_block_sizes])

    # ---- worker side -------------------------------------------------------------------------------

    def _kv_layers(self, forward_context: Any) -> dict[str, torch.Tensor]:
        layers = {}
        for name, layer in forward_context.no_compile_layers.items():
            cache = getattr(layer, "kv_cache", None)
            if isinstance(cache, (list, tuple)):
                cache = cache[0] if cache else None
            if isinstance(cache, torch.Tensor) and cache.numel() and name in self._layer_group:
                layers[name] = cache
        return layers

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, SnapshotMetadata) or not (meta.loads or meta.saves):
            return
        layers = self._kv_layers(forward_context)
        for copy in meta.saves:
            self._write(copy, layers)
        for copy in meta.loads:
            self._read(copy, layers)

    def _blocks(self, copy: _Copy, layer: str) -> torch.Tensor:
        return torch.tensor(copy.block_ids[self._layer_group[layer]], dtype=torch.long)

    def _write(self, copy: _Copy, layers: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        directory = self._root / copy.key
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {name: cache.index_select(0, self._blocks(copy, name)).contiguous()
                   for name, cache in layers.items()}
        save_file(tensors, str(directory / f"{TENSORS}.tmp"))
        os.replace(directory / f"{TENSORS}.tmp", directory / TENSORS)
        manifest = {"identity": json.loads(self._identity), "layers": sorted(tensors),
                    "blocks": [len(ids) for ids in copy.block_ids]}
        (directory / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")

    def _read(self, copy: _Copy, layers: dict[str, torch.Tensor]) -> None:
        from safetensors import safe_open

        path = self._root / copy.key / TENSORS
        with safe_open(str(path), framework="pt") as f:
            stored = set(f.keys())
            missing = sorted(set(layers) - stored)
            if missing:
                raise RuntimeError(f"{CONNECTOR_NAME}: the snapshot {path} has no KV for layers {missing[:3]}"
                                   f"{' ...' if len(missing) > 3 else ''}; make it with an engine that holds "
                                   "every layer the loading engines have (a draft model's included)")
            for name, cache in layers.items():
                saved = f.get_tensor(name)
                group = self._layer_group[name]
                first = copy.first_block[group]
                blocks = self._blocks(copy, name)
                if saved.shape[0] != len(blocks) or saved.shape[1:] != cache.shape[1:] or saved.dtype != cache.dtype:
                    raise RuntimeError(f"{CONNECTOR_NAME}: layer {name}: the snapshot holds {tuple(saved.shape)} "
                                       f"{saved.dtype}, this engine's blocks need ({len(blocks)}, "
                                       f"{', '.join(map(str, cache.shape[1:]))}) {cache.dtype}")
                if first < len(blocks):
                    cache.index_copy_(0, blocks[first:], saved[first:])

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saved whole, at the start of the step after the prompt (start_load_kv)

    def wait_for_save(self) -> None:
        return
