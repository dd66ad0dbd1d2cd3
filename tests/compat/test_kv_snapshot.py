"""compat.kv_snapshot: the benchmark harness's prompt KV snapshots (save once, load in later engines), on
made-up scheduler outputs and caches; the engines' side runs in tests/test_bench_harness.py."""

from types import SimpleNamespace as NS

import pytest
import torch

from vllm_sparsever.compat import check_signature
from vllm_sparsever.compat import kv_snapshot as snap


def test_vllm_connector_api_matches_what_the_connector_overrides():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    abstract = set(KVConnectorBase_V1.__abstractmethods__)
    assert abstract <= set(snap.CONNECTOR_HOOKS), abstract - set(snap.CONNECTOR_HOOKS)
    for name, params in snap.CONNECTOR_HOOKS.items():
        assert check_signature(KVConnectorBase_V1, name, params) is None
        assert check_signature(snap.PromptKVSnapshotConnector, name, params) is None
    from vllm.config import KVTransferConfig
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData

    config = KVTransferConfig(**snap.kv_snapshot_transfer_config("/x", save=True, machine="m"))
    assert config.get_from_extra_config("path", None) == "/x" and config.kv_connector_module_path == snap.__name__
    fields = set(CachedRequestData.__dataclass_fields__)
    assert {"req_ids", "resumed_req_ids", "new_block_ids", "num_computed_tokens"} <= fields
    assert {"req_id", "prompt_token_ids", "block_ids"} <= set(NewRequestData.__dataclass_fields__)


BLOCK = 4
LAYERS = ("model.layers.0.attn", "model.layers.1.attn", "draft_model.model.layers.0.attn")


def _connector(tmp_path, *, save=False, model="target", layers=LAYERS, role="scheduler"):
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    vllm_config = NS(kv_transfer_config=KVTransferConfig(**snap.kv_snapshot_transfer_config(tmp_path, save=save)),
                     model_config=NS(model=model, dtype=torch.bfloat16), cache_config=NS(cache_dtype="auto"))
    groups = [NS(kv_cache_spec=NS(block_size=BLOCK), layer_names=list(layers))]
    role = KVConnectorRole.SCHEDULER if role == "scheduler" else KVConnectorRole.WORKER
    return snap.PromptKVSnapshotConnector(vllm_config, role, NS(kv_cache_groups=groups))


def _caches(layers=LAYERS, blocks=12, fill=None):
    g = torch.Generator().manual_seed(0)
    return {n: NS(kv_cache=(torch.randn(blocks, 2, BLOCK, 8, generator=g).to(torch.bfloat16) if fill is None
                            else torch.full((blocks, 2, BLOCK, 8), fill, dtype=torch.bfloat16)))
            for n in layers}


def _new(req_id, tokens, blocks):
    return NS(scheduled_new_reqs=[NS(req_id=req_id, prompt_token_ids=tokens, block_ids=(list(blocks),))],
              scheduled_cached_reqs=NS(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]))


def _cached(req_id, new_blocks, computed, resumed=False):
    return NS(scheduled_new_reqs=[],
              scheduled_cached_reqs=NS(req_ids=[req_id], resumed_req_ids={req_id} if resumed else set(),
                                       new_block_ids=[None if new_blocks is None else (list(new_blocks),)],
                                       num_computed_tokens=[computed]))


def _run_worker(worker, meta, layers):
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(NS(no_compile_layers=layers))
    worker.clear_connector_metadata()


PROMPT = list(range(100, 119))  # 19 tokens: 4 whole blocks before the last token


def _save(tmp_path, layers):
    """A prompt prefilled in two chunks (blocks 5, 6 then 7, 8, 9), saved at the step after it."""
    sched, worker = _connector(tmp_path, save=True), _connector(tmp_path, save=True, role="worker")
    metas = [sched.build_connector_meta(_new("a", PROMPT, [5, 6])),
             sched.build_connector_meta(_cached("a", [7, 8, 9], 8)),
             sched.build_connector_meta(_cached("a", None, 19))]
    assert [len(m.saves) for m in metas] == [0, 0, 1] and not any(m.loads for m in metas)
    assert metas[2].saves[0].block_ids == [[5, 6, 7, 8]]
    _run_worker(worker, metas[2], layers)
    assert sched.build_connector_meta(_cached("a", None, 20)).saves == []  # once


def _scheduled_load(tmp_path, computed=0):
    """A scheduler that matched PROMPT's snapshot for request "b" (`computed` tokens cached locally) and a worker."""
    sched, worker = _connector(tmp_path), _connector(tmp_path, role="worker")
    assert sched.get_num_new_matched_tokens(NS(request_id="b", prompt_token_ids=PROMPT), computed) == (16 - computed, False)
    sched.update_state_after_alloc(NS(request_id="b"), None, 16 - computed)
    return sched, worker


def test_saved_blocks_load_into_other_block_ids_every_layer(tmp_path):
    source = _caches()
    _save(tmp_path, source)
    sched, worker = _scheduled_load(tmp_path)
    meta = sched.build_connector_meta(_new("b", PROMPT, [1, 2, 3, 4, 0]))
    assert len(meta.loads) == 1 and meta.saves == []
    dest = _caches(fill=0.0)
    _run_worker(worker, meta, dest)
    for name in LAYERS:
        assert torch.equal(dest[name].kv_cache[1:5], source[name].kv_cache[5:9])
        assert not dest[name].kv_cache[0].any() and not dest[name].kv_cache[5:].any()  # the last token's block


def test_only_the_blocks_past_a_local_prefix_hit_are_loaded(tmp_path):
    source = _caches()
    _save(tmp_path, source)
    sched, worker = _scheduled_load(tmp_path, computed=8)
    dest = _caches(fill=0.0)
    _run_worker(worker, sched.build_connector_meta(_new("b", PROMPT, [1, 2, 3, 4, 0])), dest)
    name = LAYERS[0]
    assert not dest[name].kv_cache[1:3].any()  # the engine's own cached blocks: untouched
    assert torch.equal(dest[name].kv_cache[3:5], source[name].kv_cache[7:9])
    assert sched.get_num_new_matched_tokens(NS(request_id="c", prompt_token_ids=PROMPT), 16) == (0, False)


def test_no_snapshot_for_another_prompt_model_or_a_prompt_within_one_block(tmp_path):
    _save(tmp_path, _caches())
    other = _connector(tmp_path, model="another")
    assert other.get_num_new_matched_tokens(NS(request_id="b", prompt_token_ids=PROMPT), 0) == (0, False)
    sched = _connector(tmp_path)
    assert sched.get_num_new_matched_tokens(NS(request_id="b", prompt_token_ids=PROMPT[:-1] + [7]), 0)[0] == 16
    assert sched.get_num_new_matched_tokens(NS(request_id="c", prompt_token_ids=[7] + PROMPT[1:]), 0) == (0, False)
    saver = _connector(tmp_path / "short", save=True)
    for step in (_new("s", PROMPT[:4], [1]), _cached("s", None, 4)):
        assert saver.build_connector_meta(step).saves == []


def test_a_preempted_prompt_is_not_saved(tmp_path):
    sched = _connector(tmp_path, save=True)
    sched.build_connector_meta(_new("a", PROMPT, [5, 6, 7, 8, 9]))
    assert sched.build_connector_meta(_cached("a", [1, 2, 3, 4, 0], 0, resumed=True)).saves == []
    assert sched.build_connector_meta(_cached("a", None, 19)).saves == []


def test_an_engine_with_layers_the_snapshot_lacks_or_other_shapes_is_refused(tmp_path):
    _save(tmp_path, _caches(layers=LAYERS[:2]))  # made by an engine without the draft
    sched, worker = _scheduled_load(tmp_path)
    meta = sched.build_connector_meta(_new("b", PROMPT, [1, 2, 3, 4, 0]))
    with pytest.raises(RuntimeError, match="no KV for layers .*draft_model"):
        _run_worker(worker, meta, _caches(fill=0.0))
    wide = {n: NS(kv_cache=torch.zeros(12, 2, BLOCK, 16, dtype=torch.bfloat16)) for n in LAYERS[:2]}
    with pytest.raises(RuntimeError, match="layer model.layers.0.attn: the snapshot holds"):
        _run_worker(worker, meta, wide)


def test_a_preempted_request_loads_again_into_its_new_blocks(tmp_path):
    source = _caches()
    _save(tmp_path, source)
    sched, worker = _scheduled_load(tmp_path)
    assert len(sched.build_connector_meta(_new("b", PROMPT, [1, 2, 3, 4, 0])).loads) == 1
    # preempted; scheduled again with other blocks, which must be loaded again
    assert sched.get_num_new_matched_tokens(NS(request_id="b", prompt_token_ids=PROMPT), 0) == (16, False)
    sched.update_state_after_alloc(NS(request_id="b"), None, 16)
    meta = sched.build_connector_meta(_cached("b", [11, 10, 9, 8, 7], 0, resumed=True))
    assert [c.block_ids for c in meta.loads] == [[[11, 10, 9, 8]]]
    dest = _caches(fill=0.0)
    _run_worker(worker, meta, dest)
    assert torch.equal(dest[LAYERS[2]].kv_cache[11], source[LAYERS[2]].kv_cache[5])
    assert torch.equal(dest[LAYERS[2]].kv_cache[8], source[LAYERS[2]].kv_cache[8])
