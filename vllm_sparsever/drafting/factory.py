"""The proposer a config asks for (drafting/proposer.py has the protocol)."""

from __future__ import annotations

from vllm_sparsever.config import EAGLE_HEAD_SOURCES, VLLM_DRAFTERS, SparseverConfig
from vllm_sparsever.drafting.proposer import Proposer


def check_scheduling(config: SparseverConfig, proposer: Proposer | None, async_scheduling: bool) -> None:
    """A proposer that proposes after the step's bookkeeping needs synchronous scheduling."""
    if proposer is None:
        return
    try:
        proposer.check_scheduling(async_scheduling)
    except ValueError as e:
        which = ("tree.enabled" if config.tree.enabled else
                 "adaptive.enabled" if config.adaptive.enabled else "early_exit.enabled")
        raise ValueError(f"{which} with draft_source={config.draft_source!r} needs synchronous scheduling "
                         f"(allowed: async_scheduling=False, e.g. --no-async-scheduling): {e}") from e


def make_proposer(config: SparseverConfig, max_model_len: int) -> Proposer | None:
    """sparsever's proposer, or None when vLLM's drafter proposes as it is (draft model, n-gram, EAGLE;
    draft_source='none': a proposer that proposes nothing); with adaptive, EVICT over the tree drafter
    (drafting/evict_proposer.py; over vLLM's EAGLE / MTP drafter: its chains, drafting/vllm_drafter.py);
    the self-drafter for draft_source='early_exit'; with early_exit.enabled, the hierarchy over the
    drafter (self-drafter, prompt lookup, draft model, or an EAGLE head sparsever runs itself) and the
    intermediate verifier (layers resolved in the
    front end, see resolve_self_draft)."""
    if config.draft_source == "none":
        from vllm_sparsever.drafting.no_draft import NoDraftProposer

        return NoDraftProposer()
    drafter = _drafter(config, max_model_len)
    if drafter is not None and config.adaptive.enabled:
        from vllm_sparsever.drafting.evict_proposer import EvictProposer

        return EvictProposer(drafter, config.adaptive)
    return drafter


def _drafter(config: SparseverConfig, max_model_len: int) -> Proposer | None:
    """`make_proposer`'s proposer before EVICT wraps it."""
    from vllm_sparsever.drafting.hierarchical import HierarchicalProposer
    from vllm_sparsever.drafting.tree_drafter import chain_tree

    ee = config.early_exit
    k = config.num_speculative_tokens
    # Trees as configured; EVICT alone: chains grown as one-branch trees (their path probabilities score them).
    tree = config.tree if config.tree.enabled else chain_tree(k) if config.adaptive.enabled else None
    if config.draft_source == "draft_model" and tree is not None:
        from vllm_sparsever.drafting.draft_model import DraftModelDrafter

        # (checked at start: no hierarchy with trees)
        return DraftModelDrafter(num_speculative_tokens=k, max_model_len=max_model_len, tree=tree,
                                 draft_vocab=config.draft_vocab, attention_window=config.draft_attention_window)
    if config.draft_source in EAGLE_HEAD_SOURCES and config.tree.enabled:
        from vllm_sparsever.drafting.eagle_head import EagleHeadDrafter

        # EAGLE-2 style trees: sparsever grows them with the head itself (vLLM's proposer drafts chains).
        return EagleHeadDrafter(num_speculative_tokens=k, max_model_len=max_model_len, tree=tree)
    if config.draft_source in VLLM_DRAFTERS and config.adaptive.enabled:
        from vllm_sparsever.drafting.vllm_drafter import VllmDrafterChains

        return VllmDrafterChains(num_speculative_tokens=k, max_model_len=max_model_len)
    if config.draft_source == "ngram" and config.adaptive.enabled:
        from vllm_sparsever.drafting.prompt_lookup import PromptLookupDrafter

        return PromptLookupDrafter(num_speculative_tokens=k, max_model_len=max_model_len, tree=tree)
    if config.draft_source != "early_exit" and not ee.enabled:
        return None
    round_tokens = ee.round_tokens if ee.enabled else config.num_speculative_tokens
    heads = []
    if config.draft_source == "early_exit":
        heads.append(ee.draft_layer)
    if ee.enabled and ee.intermediate == "early_exit":
        heads.append(ee.verify_layer)
    model = None
    if heads:
        from vllm_sparsever.drafting.early_exit_model import EarlyExitModel

        trimmed = {ee.draft_layer: ee.draft_vocab} if ee.draft_vocab else None
        model = EarlyExitModel(ee.heads, tuple(heads), trimmed_vocab=trimmed)
    if config.draft_source == "early_exit":
        from vllm_sparsever.drafting.self_draft import SelfDraftProposer

        drafter = SelfDraftProposer(model, exit_layer=ee.draft_layer, num_speculative_tokens=round_tokens,
                                    confidence=ee.draft_confidence, max_model_len=max_model_len, tree=tree)
    elif config.draft_source in EAGLE_HEAD_SOURCES:
        from vllm_sparsever.drafting.eagle_head import EagleHeadDrafter

        drafter = EagleHeadDrafter(num_speculative_tokens=round_tokens, max_model_len=max_model_len)
    elif config.draft_source == "draft_model":
        from vllm_sparsever.drafting.draft_model import DraftModelDrafter

        drafter = DraftModelDrafter(num_speculative_tokens=round_tokens, max_model_len=max_model_len,
                                    draft_vocab=config.draft_vocab, attention_window=config.draft_attention_window)
    else:
        from vllm_sparsever.drafting.prompt_lookup import PromptLookupDrafter

        drafter = PromptLookupDrafter(num_speculative_tokens=round_tokens, max_model_len=max_model_len)
    if not ee.enabled:
        return drafter
    from vllm_sparsever.drafting.intermediate import EarlyExitVerifier, SparseTargetVerifier

    if ee.intermediate == "sparse":
        verifier = SparseTargetVerifier()
    else:
        verifier = EarlyExitVerifier(model, ee.verify_layer)
    return HierarchicalProposer(drafter, verifier, cap=config.num_speculative_tokens, rounds=ee.full_verify_every,
                                reuse=ee.reuse_hidden_states)
