"""The EAGLE-3 head train-eagle trains: vLLM's `Eagle3LlamaForCausalLM` in plain torch, its
training-time-test forward and greedy drafting, and its save and load in vLLM's format (`config.json`
+ `model.safetensors`, which stock vLLM's `{"method": "eagle3"}` loads)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ARCHITECTURE = "LlamaForCausalLMEagle3"


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Eagle3Head(nn.Module):
    """vLLM's `Eagle3LlamaForCausalLM` (llama_eagle3.py), one decoder layer, in plain torch for
    training: its parameter names are the saved names."""

    def __init__(self, *, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                 num_aux: int, eps: float, rotary: nn.Module, lm_head: torch.Tensor) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.fc = nn.Linear(num_aux * hidden, hidden, bias=False)
        self.input_layernorm = _RMSNorm(hidden, eps)
        self.hidden_norm = _RMSNorm(hidden, eps)
        self.q_proj = nn.Linear(2 * hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.post_attention_layernorm = _RMSNorm(hidden, eps)
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.norm = _RMSNorm(hidden, eps)
        self.rotary = rotary
        self.register_buffer("lm_head", lm_head.float().contiguous(), persistent=False)  # frozen
        # The streams are divided by this before `fc` while training; folded into `fc` on save.
        self.register_buffer("aux_inv_scale", torch.ones(num_aux * hidden), persistent=False)
        for linear in (self.fc, self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.gate_proj, self.up_proj,
                       self.down_proj):
            nn.init.normal_(linear.weight, std=0.02)

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """vLLM's `combine_hidden_states`: the target's streams to the head's hidden size."""
        return self.fc(aux * self.aux_inv_scale)

    def step(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             past: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
             own: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One drafting step for every base position: (logits over the draft vocabulary, the
        pre-norm output the next step reads, this step's keys, values). `past`: (keys, values,
        boolean visibility [queries, keys]) of earlier steps this step attends to; `own`: which of
        this step's own keys each query sees."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        n = embeds.shape[0]
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        q = self.q_proj(x).view(n, self.heads, self.head_dim).transpose(0, 1)
        k = self.k_proj(x).view(n, self.kv_heads, self.head_dim).transpose(0, 1)
        v = self.v_proj(x).view(n, self.kv_heads, self.head_dim).transpose(0, 1)
        cos, sin = self.rotary(v, positions[None])
        q, k = apply_rotary_pos_emb(q[None], k[None], cos, sin)
        q, k = q[0], k[0]
        keys = torch.cat([p[0] for p in past] + [k], dim=1)
        values = torch.cat([p[1] for p in past] + [v], dim=1)
        visible = torch.cat([p[2] for p in past] + [own], dim=1)
        attn = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=visible,
                                              enable_gqa=True)[0]
        residual = self.o_proj(attn.transpose(0, 1).reshape(n, -1)) + residual
        x = self.post_attention_layernorm(residual)
        out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)) + residual
        return self.norm(out) @ self.lm_head.T, out, k, v

    def chain(self, embed: nn.Module, tokens: torch.Tensor, aux: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test over one sequence (`tokens` [T], `aux` [T, num_aux * hidden]): per step
        k = 1..steps the logits at every base s = 0..T-2 (reading token min(s+k, T-1))."""
        t = tokens.shape[0]
        bases = torch.arange(t - 1)
        causal = bases[None, :] <= bases[:, None]
        diagonal = torch.eye(t - 1, dtype=torch.bool)
        hidden = self.combine(aux[:-1])
        past: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        logits = []
        for k in range(1, steps + 1):
            embeds = embed(tokens[(bases + k).clamp(max=t - 1)])
            # Step 1's keys are every earlier base's (vLLM's draft KV of the verified tokens); a
            # later step's only its own base's (that chain's earlier drafts).
            visible = causal if k == 1 else diagonal
            step_logits, hidden, keys, values = self.step(embeds, hidden, bases + k - 1, past, visible)
            past.append((keys, values, visible))
            logits.append(step_logits)
        return logits

    @torch.no_grad()
    def draft(self, embed: nn.Module, tokens: torch.Tensor, aux: torch.Tensor, steps: int,
              forced: list[int] | None = None) -> tuple[list[int], list[torch.Tensor]]:
        """A greedy chain of `steps` drafts after `tokens` [T] as vLLM drafts it, from the target's
        streams `aux` at positions 0..T-2 (the last token is the one the target just sampled).
        Returns the draft ids (the draft vocabulary's) and each step's logits; `forced`: the drafts
        to feed to later steps instead (to follow another drafter's chain)."""
        n = tokens.shape[0] - 1
        bases = torch.arange(n)
        logits, hidden, keys, values = self.step(embed(tokens[1:]), self.combine(aux[:n]), bases, [],
                                                 bases[None, :] <= bases[:, None])
        drafts, step_logits = [int(logits[-1].argmax())], [logits[-1]]
        past = [(keys, values, torch.ones(1, n, dtype=torch.bool))]
        hidden = hidden[-1:]
        own = torch.ones(1, 1, dtype=torch.bool)
        for k in range(1, steps):
            token = torch.tensor([forced[k - 1] if forced else drafts[-1]])
            logits, hidden, keys, values = self.step(embed(token), hidden, torch.tensor([n - 1 + k]), past, own)
            past.append((keys, values, own))
            drafts.append(int(logits[0].argmax()))
            step_logits.append(logits[0])
        return drafts, step_logits

    def state_for_vllm(self) -> dict[str, torch.Tensor]:
        names = {"fc": "fc", "norm": "norm", "input_layernorm": "midlayer.input_layernorm",
                 "hidden_norm": "midlayer.hidden_norm", "post_attention_layernorm": "midlayer.post_attention_layernorm",
                 **{p: f"midlayer.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
                 **{p: f"midlayer.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")}}
        state = {f"{names[name.rsplit('.', 1)[0]]}.weight": p.detach().contiguous().clone()
                 for name, p in self.named_parameters()}
        state["lm_head.weight"] = self.lm_head.contiguous().clone()
        state["fc.weight"] = (state["fc.weight"] * self.aux_inv_scale[None, :]).contiguous()
        return state


def load_head(path: str | Path, target_config: dict[str, Any]) -> tuple[Eagle3Head, tuple[int, ...], torch.Tensor]:
    """A head `train_eagle` wrote: (the head, its aux layer ids, draft id -> target id)."""
    from safetensors.torch import load_file

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    weights = load_file(str(path / "model.safetensors"))
    aux = tuple(config["eagle_aux_hidden_state_layer_ids"])
    head = Eagle3Head(hidden=config["hidden_size"], heads=config["num_attention_heads"],
                      kv_heads=config["num_key_value_heads"], head_dim=config["head_dim"],
                      intermediate=config["intermediate_size"], num_aux=len(aux), eps=config["rms_norm_eps"],
                      rotary=rotary_embedding(target_config, config["head_dim"]), lm_head=weights["lm_head.weight"])
    saved = head.state_for_vllm()
    head.load_state_dict({name: weights[saved_name] for (name, _), saved_name
                          in zip(head.named_parameters(), [k for k in saved if k != "lm_head.weight"], strict=True)})
    draft_ids = torch.arange(config["draft_vocab_size"])
    if "d2t" in weights:
        draft_ids = draft_ids + weights["d2t"]
    return head.eval(), aux, draft_ids



def rotary_embedding(config: dict[str, Any], head_dim: int) -> nn.Module:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    keys = ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings")
    return LlamaRotaryEmbedding(LlamaConfig(hidden_size=config["hidden_size"], head_dim=head_dim,
                                            num_attention_heads=config["num_attention_heads"],
                                            **{k: config[k] for k in keys if config.get(k) is not None}))



def new_head(config: dict[str, Any], num_aux: int, intermediate: int, lm_head: torch.Tensor) -> Eagle3Head:
    """An untrained head for the target `config`, its LM head `lm_head` (the draft vocabulary's rows)."""
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    return Eagle3Head(hidden=hidden, heads=heads, kv_heads=int(config.get("num_key_value_heads") or heads),
                      head_dim=head_dim, intermediate=intermediate, num_aux=num_aux,
                      eps=float(config.get("rms_norm_eps", 1e-6)), rotary=rotary_embedding(config, head_dim), lm_head=lm_head)


def save_head(output_dir: Path, head: Eagle3Head, draft_ids: torch.Tensor, config: dict[str, Any],
              aux_layers: tuple[int, ...]) -> None:
    """`config.json` + `model.safetensors` in vLLM's EAGLE-3 format."""
    from safetensors.torch import save_file

    output_dir.mkdir(parents=True, exist_ok=True)
    vocab = int(config["vocab_size"])
    state = head.state_for_vllm()
    if len(draft_ids) < vocab:
        state["d2t"] = draft_ids - torch.arange(len(draft_ids))  # vLLM: target id = draft id + d2t[draft id]
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[draft_ids] = True
        state["t2d"] = t2d
    save_file(state, str(output_dir / "model.safetensors"))
    # The rotary settings must be the target's (transformers 5 writes them as `rope_parameters`): the
    # head was trained with them, and vLLM builds the head's rotary embedding from this config.
    keys = ("vocab_size", "max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters", "bos_token_id",
            "eos_token_id")
    head_config = {
        "architectures": [ARCHITECTURE], "model_type": "llama", "hidden_size": int(config["hidden_size"]),
        "intermediate_size": head.down_proj.in_features, "num_attention_heads": head.heads,
        "num_key_value_heads": head.kv_heads, "head_dim": head.head_dim, "num_hidden_layers": 1, "hidden_act": "silu",
        "rms_norm_eps": head.norm.eps, "tie_word_embeddings": False, "torch_dtype": "float32",
        "draft_vocab_size": len(draft_ids), "target_hidden_size": int(config["hidden_size"]),
        "eagle_aux_hidden_state_layer_ids": list(aux_layers),
        **{k: config[k] for k in keys if config.get(k) is not None},
    }
    (output_dir / "config.json").write_text(json.dumps(head_config, indent=1) + "\n")
