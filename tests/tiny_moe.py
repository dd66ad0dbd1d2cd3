"""A tiny random Mixtral (MoE) model generated on the fly, for MoE sparsity tests."""

from __future__ import annotations

from pathlib import Path

import torch

from tiny_models import _VOCAB_WORDS, save_model


def make_tiny_mixtral(
    path: Path,
    *,
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    num_experts: int = 8,
    top_k: int = 3,
    max_position_embeddings: int = 2048,
) -> Path:
    """A random MixtralForCausalLM (fp32). head_dim = hidden/heads must be >= 32 (CPU attention);
    hidden and intermediate sizes multiples of 32 (vLLM-CPU's grouped-GEMM MoE kernel)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    assert hidden_size // num_heads >= 32, "vLLM's CPU attention needs head_dim >= 32"
    assert hidden_size % 32 == 0 and intermediate_size % 32 == 0, "vLLM-CPU MoE needs multiples of 32"
    torch.manual_seed(seed)
    config = MixtralConfig(
        vocab_size=len(_VOCAB_WORDS) + 3,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        num_local_experts=num_experts,
        num_experts_per_tok=top_k,
        max_position_embeddings=max_position_embeddings,
        sliding_window=None,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    return save_model(MixtralForCausalLM(config), path)


def make_tiny_qwen2_moe(
    path: Path,
    *,
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    moe_intermediate_size: int = 64,
    shared_expert_intermediate_size: int = 96,
    intermediate_size: int = 128,
    num_experts: int = 8,
    top_k: int = 3,
    mlp_only_layers: tuple[int, ...] = (0,),
    max_position_embeddings: int = 2048,
) -> Path:
    """A random Qwen2MoeForCausalLM (fp32) with a shared expert (and its sigmoid gate) and dense layers
    (`mlp_only_layers`). Same size rules as `make_tiny_mixtral`."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    assert hidden_size // num_heads >= 32, "vLLM's CPU attention needs head_dim >= 32"
    assert hidden_size % 32 == 0 and moe_intermediate_size % 32 == 0, "vLLM-CPU MoE needs multiples of 32"
    torch.manual_seed(seed)
    config = Qwen2MoeConfig(
        vocab_size=len(_VOCAB_WORDS) + 3,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        moe_intermediate_size=moe_intermediate_size,
        shared_expert_intermediate_size=shared_expert_intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=list(mlp_only_layers),
        max_position_embeddings=max_position_embeddings,
        use_sliding_window=False,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    return save_model(Qwen2MoeForCausalLM(config), path)
