"""MoEfication: turn a dense SwiGLU (Llama) model into a Mixtral-format MoE with real weights.

Per layer:
1. Capture the FFN inputs x of the dense model on calibration text.
2. Keep the S neurons with the largest mean output contribution as *shared* (copied into every
   expert: Mixtral has no shared expert, this emulates one), then split the other neurons into E equal experts by balanced k-means on their
   co-activation patterns (|act| over calibration tokens): neurons that fire together share an expert.
3. Score each expert per token by the norm of its contribution to the FFN output,
   ||W_down[:, e] act_e(x)||, and fit a linear router (softmax cross-entropy on the top-k experts).
4. Write Mixtral tensors: w1 = gate rows, w3 = up rows, w2 = down columns of each expert.

Why the output is exactly the dense FFN at top-E-of-E: Mixtral (HF and vLLM) softmaxes the router
logits, keeps the top-k and renormalises those weights to sum to 1. We scale the router by a
tiny power of two (ordering is unchanged, so routing is too) so that the renormalised weights are
1/k to within ~1e-3, and fold the factor k into w2. Each selected expert then adds its exact partial
FFN; with k = E that is the dense FFN, with k < E the missing experts' share is dropped.
Note for expert pruning: the weights are (nearly) uniform by construction; rank experts by
router logits (the top-k order), not by weight.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

ROUTER_LOGIT_SCALE = 2.0**-14


@dataclass(frozen=True)
class MoEficationConfig:
    num_experts: int = 8
    top_k: int = 4
    # Neurons with the largest mean output contribution, copied into every expert (a shared
    # expert emulated inside the Mixtral format): without them top-k collapses (see docs).
    shared_neurons: int = 0
    seed: int = 0
    calib_seq_len: int = 512
    calib_sequences: int = 32  # 16K calibration tokens
    cluster_tokens: int = 4096  # tokens whose activations describe a neuron for clustering
    kmeans_iters: int = 25
    router_steps: int = 100
    router_lr: float = 2e-2
    router_tokens: int = 8192  # tokens the router is fitted on
    router_holdout: int = 2048  # other tokens, used to report the router's top-k recall


# ---------------------------------------------------------------------------------------------
# Clustering and routing (pure tensor functions: unit-tested on small random inputs)


def balanced_kmeans(features: torch.Tensor, num_clusters: int, iters: int, seed: int) -> torch.Tensor:
    """Cluster rows of `features` [N, D] into `num_clusters` groups of exactly N / num_clusters rows
    (cosine similarity, greedy capacity-constrained assignment). Returns labels [N]."""
    n = features.shape[0]
    if n % num_clusters:
        raise ValueError(f"{n} neurons do not split into {num_clusters} equal experts")
    capacity = n // num_clusters
    feats = F.normalize(features.float(), dim=1)
    # Row gathers from a transposed `features` are strided; gather from a row-major copy (same values).
    rows = feats.contiguous()
    gen = torch.Generator().manual_seed(seed)
    centroids = rows[torch.randperm(n, generator=gen)[:num_clusters]].clone()
    labels = torch.empty(n, dtype=torch.long)
    for _ in range(iters):
        # A contiguous right operand takes MKL's fast path with the same result as `feats @ centroids.T`.
        scores = torch.mm(feats, centroids.T.contiguous())
        labels = torch.from_numpy(_greedy_balanced_assign(scores.numpy(), capacity))
        new_centroids = F.normalize(torch.stack([rows[labels == c].mean(0) for c in range(num_clusters)]), dim=1)
        if torch.allclose(new_centroids, centroids, atol=1e-6):
            break
        centroids = new_centroids
    return labels


def _greedy_balanced_assign(scores: np.ndarray, capacity: int) -> np.ndarray:
    """Visit (row, cluster) pairs by decreasing score; give each row the best cluster with room."""
    n, k = scores.shape
    order = np.argsort(-scores, axis=None, kind="stable")
    labels = [-1] * n
    fill = [0] * k
    remaining = n
    for flat in order.tolist():
        row, cluster = divmod(flat, k)
        if labels[row] < 0 and fill[cluster] < capacity:
            labels[row] = cluster
            fill[cluster] += 1
            remaining -= 1
            if remaining == 0:
                break
    return np.asarray(labels, dtype=np.int64)


def expert_indices(labels: torch.Tensor, num_experts: int) -> list[torch.Tensor]:
    return [torch.nonzero(labels == e).flatten() for e in range(num_experts)]


def swiglu_act(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    return F.silu(x @ w_gate.T) * (x @ w_up.T)


def expert_scores(act: torch.Tensor, w_down: torch.Tensor, experts: Sequence[torch.Tensor]) -> torch.Tensor:
    """[T, E]: norm of each expert's contribution to the FFN output."""
    return torch.stack([(act[:, idx] @ w_down[:, idx].T).norm(dim=1) for idx in experts], dim=1)


def fit_router(
    x: torch.Tensor, scores: torch.Tensor, top_k: int, steps: int, lr: float, seed: int
) -> torch.Tensor:
    """Linear router [E, H] whose logits rank each token's top-k experts (by `scores`) first."""
    torch.manual_seed(seed)
    target = torch.zeros_like(scores)
    target.scatter_(1, scores.topk(top_k, dim=1).indices, 1.0 / top_k)
    # Normalise inputs for a well-conditioned fit; fold the normalisation back into the weight.
    scale = x.pow(2).mean().sqrt().clamp_min(1e-6)
    xs = x / scale
    # Start from the ridge-regression fit of the top-k indicator (one small solve), then refine
    # the ranking with softmax cross-entropy.
    gram = xs.T @ xs + 1e-2 * xs.shape[0] * torch.eye(xs.shape[1])
    weight = torch.linalg.solve(gram, xs.T @ (target * top_k)).T.contiguous()
    opt = torch.optim.Adam([weight], lr=lr)
    for _ in range(steps):
        # Gradient of the mean cross-entropy, written out: autograd's backward of this skinny
        # matmul is several times slower on CPU than the two plain matmuls.
        weight.grad = (F.softmax(xs @ weight.T, dim=1) - target).T @ xs / xs.shape[0]
        opt.step()
    return (weight / scale).contiguous()


def topk_recall(logits: torch.Tensor, scores: torch.Tensor, top_k: int) -> float:
    """Mean fraction of the true top-k experts (by score) that the router's top-k contains."""
    pred = F.one_hot(logits.topk(top_k, dim=1).indices, logits.shape[1]).sum(1)
    true = F.one_hot(scores.topk(top_k, dim=1).indices, scores.shape[1]).sum(1)
    return float((pred * true).sum(1).float().mean() / top_k)


def expert_tensors(w_gate, w_up, w_down, experts, shared, top_k: int) -> list[tuple[torch.Tensor, ...]]:
    """(w1, w3, w2) per expert. Every expert holds the shared neurons plus its own; the k selected
    experts get weight ~1/k each, so own down-columns are scaled by k (exact partial FFN) and the
    shared ones are not (k copies x 1/k = once)."""
    out = []
    for idx in experts:
        rows = torch.cat([shared, idx]) if shared is not None and shared.numel() else idx
        scale = torch.ones(rows.numel(), dtype=w_down.dtype)
        scale[rows.numel() - idx.numel() :] = top_k
        out.append((w_gate[rows], w_up[rows], w_down[:, rows] * scale))
    return out


class MoEFFN(torch.nn.Module):
    """Reference Mixtral-semantics MoE FFN built from dense SwiGLU weights (evaluation and tests)."""

    def __init__(self, w_gate, w_up, w_down, experts: Sequence[torch.Tensor], router: torch.Tensor, top_k: int,
                 shared: torch.Tensor | None = None):  # fmt: skip
        super().__init__()
        self.top_k = top_k
        self.router = torch.nn.Parameter(router * ROUTER_LOGIT_SCALE, requires_grad=False)
        tensors = expert_tensors(w_gate.detach(), w_up.detach(), w_down.detach(), experts, shared, top_k)
        self.w1 = torch.nn.ParameterList([torch.nn.Parameter(t[0].clone(), requires_grad=False) for t in tensors])
        self.w3 = torch.nn.ParameterList([torch.nn.Parameter(t[1].clone(), requires_grad=False) for t in tensors])
        self.w2 = torch.nn.ParameterList([torch.nn.Parameter(t[2].clone(), requires_grad=False) for t in tensors])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        probs = F.softmax((x @ self.router.T).float(), dim=1)
        weights, ids = probs.topk(self.top_k, dim=1)
        weights = (weights / weights.sum(1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for e in range(len(self.w1)):
            token, slot = torch.nonzero(ids == e, as_tuple=True)
            if token.numel() == 0:
                continue
            xe = x[token]
            ye = (F.silu(xe @ self.w1[e].T) * (xe @ self.w3[e].T)) @ self.w2[e].T
            out.index_add_(0, token, ye * weights[token, slot, None])
        return out.reshape(shape)


# ---------------------------------------------------------------------------------------------
# Whole-model MoEfication


@dataclass
class LayerMoE:
    experts: list[torch.Tensor]  # routed neuron indices per expert
    router: torch.Tensor  # unscaled logits weight [E, H]
    router_recall: float
    shared: torch.Tensor  # neuron indices present in every expert (may be empty)


def capture_ffn_inputs(model, input_ids: torch.Tensor, batch: int = 4) -> list[torch.Tensor]:
    """Per decoder layer, the inputs of its MLP for every token of `input_ids` [N, L] -> [N*L, H]."""
    layers = model.model.layers
    captured: list[list[torch.Tensor]] = [[] for _ in layers]
    hooks = [
        layer.mlp.register_forward_pre_hook(lambda _m, args, i=i: captured[i].append(args[0].reshape(-1, args[0].shape[-1]).float()))
        for i, layer in enumerate(layers)
    ]
    try:
        with torch.no_grad():
            for start in tqdm(range(0, input_ids.shape[0], batch), desc="calibration forward", leave=False):
                # The LM head's logits are not needed (the hooks capture the MLP inputs): keep one position.
                model(input_ids=input_ids[start : start + batch], logits_to_keep=1)
    finally:
        for hook in hooks:
            hook.remove()
    return [torch.cat(c) for c in captured]


def moefy_layer(mlp, x: torch.Tensor, cfg: MoEficationConfig, layer_seed: int) -> LayerMoE:
    w_gate = mlp.gate_proj.weight.detach().float()
    w_up = mlp.up_proj.weight.detach().float()
    w_down = mlp.down_proj.weight.detach().float()
    gen = torch.Generator().manual_seed(layer_seed)
    perm = torch.randperm(x.shape[0], generator=gen)
    x = x[perm]
    act_sample = swiglu_act(x[: cfg.cluster_tokens], w_gate, w_up)
    importance = act_sample.abs().mean(0) * w_down.norm(dim=0)  # mean |contribution| per neuron
    shared = torch.sort(importance.topk(cfg.shared_neurons).indices).values
    routed = torch.ones(w_gate.shape[0], dtype=torch.bool)
    routed[shared] = False
    routed = torch.nonzero(routed).flatten()
    labels = balanced_kmeans(act_sample[:, routed].abs().T, cfg.num_experts, cfg.kmeans_iters, layer_seed)
    experts = [routed[idx] for idx in expert_indices(labels, cfg.num_experts)]
    n_hold = min(cfg.router_holdout, x.shape[0] // 4)
    x = x[: n_hold + cfg.router_tokens]
    scores = expert_scores(swiglu_act(x, w_gate, w_up), w_down, experts)
    train = slice(n_hold, n_hold + cfg.router_tokens)
    router = fit_router(x[train], scores[train], cfg.top_k, cfg.router_steps, cfg.router_lr, layer_seed)
    recall = topk_recall(x[:n_hold] @ router.T, scores[:n_hold], cfg.top_k) if n_hold else float("nan")
    return LayerMoE(experts, router, recall, shared)


def moefy_model(model, calib_ids: torch.Tensor, cfg: MoEficationConfig) -> list[LayerMoE]:
    inputs = capture_ffn_inputs(model, calib_ids)
    layers = []
    for i, layer in enumerate(tqdm(model.model.layers, desc="moefy layers")):
        layers.append(moefy_layer(layer.mlp, inputs[i], cfg, cfg.seed * 1000 + i))
        inputs[i] = None  # free as we go
    return layers


def patch_model_with_moe(model, layers: Sequence[LayerMoE], top_k: int) -> None:
    """Replace every dense MLP in place by its reference MoE (for quality evaluation)."""
    for layer, moe in zip(model.model.layers, layers):
        mlp = layer.mlp
        layer.mlp = MoEFFN(
            mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach(), mlp.down_proj.weight.detach(),
            moe.experts, moe.router.to(mlp.gate_proj.weight.dtype), top_k, moe.shared,
        )  # fmt: skip


def dense_config_fields(c) -> dict[str, Any]:
    """The fields a MoE checkpoint built from dense model config `c` copies unchanged (attention,
    norms, rotary, tokens); shared by the Mixtral and the fine-grained Qwen2-MoE builds."""
    rope = getattr(c, "rope_parameters", None) or {"rope_type": "default", "rope_theta": getattr(c, "rope_theta", 10000.0)}
    return {
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "hidden_act": c.hidden_act,
        "max_position_embeddings": c.max_position_embeddings,
        "initializer_range": c.initializer_range,
        "rms_norm_eps": c.rms_norm_eps,
        "use_cache": True,
        "pad_token_id": c.pad_token_id,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id,
        "tie_word_embeddings": bool(c.tie_word_embeddings),
        "rope_parameters": dict(rope),
        "rope_theta": dict(rope).get("rope_theta", 10000.0),
        "sliding_window": None,
        "attention_dropout": 0.0,
    }


def mixtral_config(dense_config, cfg: MoEficationConfig, dtype: str) -> dict[str, Any]:
    c = dense_config
    routed = c.intermediate_size - cfg.shared_neurons
    if routed % cfg.num_experts:
        raise ValueError(f"{routed} routed neurons do not split into {cfg.num_experts} equal experts")
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        **dense_config_fields(c),
        "intermediate_size": routed // cfg.num_experts + cfg.shared_neurons,
        "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        "num_experts_per_tok": cfg.top_k,
        "num_local_experts": cfg.num_experts,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.0,
        "router_jitter_noise": 0.0,
        "dtype": dtype,
    }


def mixtral_state_dict(model, layers: Sequence[LayerMoE], cfg: MoEficationConfig, dtype: torch.dtype) -> dict:
    """Mixtral checkpoint tensors (the names vLLM and HF load): attention and norms copied,
    FFN split into experts, router scaled (see module docstring)."""
    sd = {}
    dense = {k: v.detach() for k, v in model.state_dict().items()}
    for name, tensor in dense.items():
        if ".mlp." in name:
            continue
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        sd[name] = tensor
    for i, moe in enumerate(layers):
        p = f"model.layers.{i}"
        w_gate = dense[f"{p}.mlp.gate_proj.weight"].float()
        w_up = dense[f"{p}.mlp.up_proj.weight"].float()
        w_down = dense[f"{p}.mlp.down_proj.weight"].float()
        sd[f"{p}.block_sparse_moe.gate.weight"] = moe.router * ROUTER_LOGIT_SCALE
        for e, (w1, w3, w2) in enumerate(expert_tensors(w_gate, w_up, w_down, moe.experts, moe.shared, cfg.top_k)):
            q = f"{p}.block_sparse_moe.experts.{e}"
            sd[f"{q}.w1.weight"] = w1
            sd[f"{q}.w3.weight"] = w3
            sd[f"{q}.w2.weight"] = w2
    return {k: v.to(dtype).contiguous() for k, v in sd.items()}


# ---------------------------------------------------------------------------------------------
# Calibration text and the folder builder


def calibration_texts() -> list[str]:
    """Deterministic calibration text from the *train* splits only: gensim's Lee background news
    corpus and the first half of its Wikipedia dump (the data categories use the other halves)."""
    from vllm_sparsever.data import builders, sources
    from vllm_sparsever.data.text import read_lines
    from vllm_sparsever.store.packages import locate

    texts = read_lines(locate(sources.LEE_BACKGROUND))
    texts += [a.text for a in builders.wikipedia_articles(split="train")]
    return texts


def heldout_texts() -> list[str]:
    """Evaluation text disjoint from calibration: Lee test documents and the second half of the dump."""
    from vllm_sparsever.data import builders, sources
    from vllm_sparsever.data.text import read_lines
    from vllm_sparsever.store.packages import locate

    texts = read_lines(locate(sources.LEE_TEST))
    texts += [a.text for a in builders.wikipedia_articles(split="test")]
    return texts


def pack_sequences(tokenizer, texts: Iterable[str], seq_len: int, num_sequences: int, seed: int) -> torch.Tensor:
    """Shuffle documents (seeded), tokenize, concatenate with EOS separators and cut [N, seq_len]."""
    docs = list(texts)
    random.Random(seed).shuffle(docs)
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    for doc in docs:
        ids.extend(tokenizer(doc, add_special_tokens=False)["input_ids"])
        ids.append(eos)
        if len(ids) >= seq_len * num_sequences:
            break
    n = min(num_sequences, len(ids) // seq_len)
    if n == 0:
        raise ValueError("not enough calibration text")
    return torch.tensor(ids[: n * seq_len]).reshape(n, seq_len)


def load_dense(base_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    if type(model).__name__ != "LlamaForCausalLM":
        raise ValueError(f"MoEfication expects a Llama (SwiGLU) model, got {type(model).__name__}")
    return model, tokenizer


def write_mixtral_folder(model, tokenizer, layers, cfg: MoEficationConfig, out_dir: Path, dtype: str, base_dir: Path):
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    state = mixtral_state_dict(model, layers, cfg, getattr(torch, dtype))
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(mixtral_config(model.config, cfg, dtype), indent=2) + "\n")
    tokenizer.save_pretrained(out_dir)
    generation = base_dir / "generation_config.json"
    if generation.is_file():
        (out_dir / "generation_config.json").write_text(generation.read_text())
    experts = {str(i): {"shared": moe.shared.tolist(), "experts": [idx.tolist() for idx in moe.experts]} for i, moe in enumerate(layers)}
    (out_dir / "moefication_experts.json").write_text(json.dumps(experts) + "\n")


def build_moe_folder(base_dir: Path, out_dir: Path, cfg: MoEficationConfig, dtype: str = "bfloat16") -> dict[str, Any]:
    """MoEfy the dense model in `base_dir` and write a Mixtral folder to `out_dir`; returns manifest facts."""
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_dense(base_dir)
    calib = pack_sequences(tokenizer, calibration_texts(), cfg.calib_seq_len, cfg.calib_sequences, cfg.seed)
    layers = moefy_model(model, calib, cfg)
    write_mixtral_folder(model, tokenizer, layers, cfg, out_dir, dtype, base_dir)
    recalls = [moe.router_recall for moe in layers]
    return {
        "architecture": "MixtralForCausalLM",
        "moefication": {
            **asdict(cfg),
            "calibration_tokens": int(calib.numel()),
            "calibration_text": "gensim==4.4.0 lee_background.cor + first half of the enwiki test dump",
            "router_logit_scale": ROUTER_LOGIT_SCALE,
            "router_topk_recall_heldout_mean": round(sum(recalls) / len(recalls), 4),
            "router_topk_recall_heldout_per_layer": [round(r, 4) for r in recalls],
        },
    }


def perplexity(model, ids: torch.Tensor, batch: int = 4) -> float:
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, ids.shape[0], batch):
            chunk = ids[start : start + batch]
            logits = model(input_ids=chunk).logits[:, :-1].float()
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1), reduction="sum").item()
            count += chunk[:, 1:].numel()
    return math.exp(total / count)
