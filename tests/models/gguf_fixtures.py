"""A tiny random Qwen2 model written as a GGUF with the `gguf` writer (no hub, no packages)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def _byte_level_vocab() -> list[str]:
    """GPT-2's byte -> printable-character table (the alphabet of every byte-level BPE)."""
    from tokenizers.pre_tokenizers import ByteLevel

    return sorted(ByteLevel.alphabet())


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "e r"]


def make_tiny_qwen2(seed: int = 0, hidden: int = 64, layers: int = 2, heads: int = 2, kv_heads: int = 1, inter: int = 128):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokens = _byte_level_vocab() + [m.replace(" ", "") for m in MERGES] + SPECIALS
    config = Qwen2Config(
        vocab_size=len(tokens),
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=len(tokens) - 3,
        eos_token_id=len(tokens) - 1,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # random norms/biases so that every tensor is checked
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model, tokens


def write_gguf(model, tokens: list[str], path: Path, quantize_ffn: bool = False, add_bos: bool | None = False) -> Path:
    """Qwen2 tensors under llama.cpp names; F32 everywhere, or Q8_0 for the FFN matrices."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name("tiny-qwen2")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"] if getattr(c, "rope_parameters", None) else c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(MERGES)
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    w.add_pad_token_id(c.bos_token_id)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    }  # fmt: skip
    for name, tensor in model.state_dict().items():
        if name in names:
            gname = names[name]
        else:
            parts = name.split(".")
            layer, module, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
            gname = f"blk.{layer}.{per_layer[module]}.{kind}"
        data = tensor.detach().float().numpy()
        if quantize_ffn and gname.split(".")[-2] in ("ffn_gate", "ffn_up", "ffn_down"):
            q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gname, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
