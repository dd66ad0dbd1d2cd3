"""Fine-grained MoEfication: a dense SwiGLU (Llama) model -> a Qwen2-MoE with a real shared expert.

Per MoE layer (the layers in `dense_layers` keep their dense FFN, `mlp_only_layers` in the config):
1. Capture the FFN inputs x of the dense model on calibration text (same text as `moefication`).
2. Shared expert: the S neurons with the largest mean output contribution (`mean |act| * ||W_down[:, n]||`).
3. Routed experts: the other neurons split into E equal clusters of co-activated neurons (balanced k-means
   on |act| patterns), e.g. 32 experts of 32 neurons.
4. Router: linear, fitted to rank first the k experts with the largest output norm ||W_down[:, e] act_e(x)||
   (ridge init + softmax cross-entropy, `moefication.fit_router`).
5. Qwen2-MoE tensors: `mlp.gate` (router), `mlp.experts.N.{gate,up,down}_proj`, `mlp.shared_expert.*`,
   `mlp.shared_expert_gate` (zeros), zero q/k/v biases (Qwen2-MoE attention has them).

Exactness at top-E-of-E (as `moefication`): Qwen2-MoE with `norm_topk_prob` softmaxes the router logits,
keeps the top k and renormalises them to sum 1. The router is scaled by 2^-14 (routing order unchanged), so
each selected expert gets ~1/k; its down projection is multiplied by k. The shared expert's output is
multiplied by sigmoid(shared_expert_gate(x)) = sigmoid(0) = 0.5 exactly, so its down projection is
multiplied by 2. Top-E-of-E then equals the dense FFN; top-k adds the selected experts' exact partial FFNs
to the whole shared part. For expert pruning: routing weights are near-uniform by construction (rank
experts by router logits / the top-k order; a routing-weight ratio threshold prunes nothing).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from vllm_sparsever.models import moefication as moe

ROUTER_LOGIT_SCALE = moe.ROUTER_LOGIT_SCALE
SHARED_GATE_FACTOR = 2.0  # 1 / sigmoid(0): the zero shared-expert gate halves the shared output


@dataclass(frozen=True)
class FineGrainedConfig:
    num_experts: int = 32
    top_k: int = 8
    shared_neurons: int = 512
    dense_layers: tuple[int, ...] = (0,)
    seed: int = 0
    calib_seq_len: int = 512
    calib_sequences: int = 32
    cluster_tokens: int = 4096
    kmeans_iters: int = 25
    router_steps: int = 200
    router_lr: float = 2e-2
    router_tokens: int = 8192
    router_holdout: int = 2048
    # Router targets mixed with their neighbours' (same sequence, +-router_window tokens): 0 = each
    # token's own top-k experts; > 0 trades per-token recall for experts shared by consecutive tokens.
    router_smoothing: float = 0.0
    router_window: int = 4

    def layer_config(self) -> moe.MoEficationConfig:
        return moe.MoEficationConfig(
            num_experts=self.num_experts, top_k=self.top_k, shared_neurons=self.shared_neurons, seed=self.seed,
            calib_seq_len=self.calib_seq_len, calib_sequences=self.calib_sequences,
            cluster_tokens=self.cluster_tokens, kmeans_iters=self.kmeans_iters, router_steps=self.router_steps,
            router_lr=self.router_lr, router_tokens=self.router_tokens, router_holdout=self.router_holdout,
        )  # fmt: skip

    def moe_intermediate_size(self, intermediate_size: int) -> int:
        routed = intermediate_size - self.shared_neurons
        if routed <= 0 or routed % self.num_experts:
            raise ValueError(f"{routed} routed neurons do not split into {self.num_experts} equal experts")
        return routed // self.num_experts


def smooth_scores(scores: torch.Tensor, seq_len: int, window: int, alpha: float) -> torch.Tensor:
    """[T, E] expert scores in sequence order (T = sequences x seq_len) -> per-token score shares mixed with
    the mean share over the +-window neighbours in the same sequence: (1 - alpha) p_t + alpha mean(p)."""
    num_experts = scores.shape[1]
    p = scores / scores.sum(1, keepdim=True).clamp_min(1e-12)
    seqs = p.reshape(-1, seq_len, num_experts).transpose(1, 2)  # [N, E, L]
    pooled = F.avg_pool1d(seqs, 2 * window + 1, stride=1, padding=window, count_include_pad=False)
    return ((1 - alpha) * seqs + alpha * pooled).transpose(1, 2).reshape(-1, num_experts)


def moefy_layer(mlp, x: torch.Tensor, cfg: FineGrainedConfig, layer_seed: int) -> moe.LayerMoE:
    """`moefication.moefy_layer` (same shared set, experts, token split and router fit), with the router
    optionally fitted on neighbour-smoothed targets (x in sequence order, cfg.calib_seq_len per sequence).
    The reported recall is against each token's own top-k experts."""
    lcfg = cfg.layer_config()
    if cfg.router_smoothing <= 0:
        return moe.moefy_layer(mlp, x, lcfg, layer_seed)
    w_gate = mlp.gate_proj.weight.detach().float()
    w_up = mlp.up_proj.weight.detach().float()
    w_down = mlp.down_proj.weight.detach().float()
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(layer_seed))
    xp = x[perm]
    act_sample = moe.swiglu_act(xp[: lcfg.cluster_tokens], w_gate, w_up)
    importance = act_sample.abs().mean(0) * w_down.norm(dim=0)
    shared = torch.sort(importance.topk(lcfg.shared_neurons).indices).values
    routed = torch.ones(w_gate.shape[0], dtype=torch.bool)
    routed[shared] = False
    routed = torch.nonzero(routed).flatten()
    labels = moe.balanced_kmeans(act_sample[:, routed].abs().T, lcfg.num_experts, lcfg.kmeans_iters, layer_seed)
    experts = [routed[idx] for idx in moe.expert_indices(labels, lcfg.num_experts)]
    chunks = [moe.expert_scores(moe.swiglu_act(c, w_gate, w_up), w_down, experts) for c in x.split(4096)]
    scores_all = torch.cat(chunks)
    target_all = smooth_scores(scores_all, cfg.calib_seq_len, cfg.router_window, cfg.router_smoothing)
    n_hold = min(lcfg.router_holdout, x.shape[0] // 4)
    train = perm[n_hold : n_hold + lcfg.router_tokens]
    hold = perm[:n_hold]
    router = moe.fit_router(x[train], target_all[train], lcfg.top_k, lcfg.router_steps, lcfg.router_lr, layer_seed)
    recall = moe.topk_recall(x[hold] @ router.T, scores_all[hold], lcfg.top_k) if n_hold else float("nan")
    return moe.LayerMoE(experts, router, recall, shared)


def moefy_layers(model, inputs: list[torch.Tensor | None], cfg: FineGrainedConfig) -> dict[int, moe.LayerMoE]:
    """LayerMoE for every layer not in `cfg.dense_layers` (inputs of processed layers are freed)."""
    out = {}
    for i, layer in enumerate(tqdm(model.model.layers, desc="moefy layers", leave=False)):
        if i in cfg.dense_layers:
            continue
        out[i] = moefy_layer(layer.mlp, inputs[i], cfg, cfg.seed * 1000 + i)
        inputs[i] = None
    return out


# ---------------------------------------------------------------------------------------------
# Reference Qwen2-MoE-semantics FFN (evaluation and tests)


class FineGrainedMoEFFN(torch.nn.Module):
    """Qwen2-MoE block semantics on the dense weights: softmax top-k (renormalised) over the scaled
    router, each selected expert's partial FFN scaled by k * weight, plus the whole shared part.

    Computed as one masked dense FFN (per token, a weight per neuron), which equals the per-expert sum.
    `record` collects the routed expert ids [T, k] of every call (distinct-experts statistics)."""

    def __init__(self, mlp, layer: moe.LayerMoE, top_k: int, num_experts: int | None = None):
        super().__init__()
        self.w_gate = mlp.gate_proj.weight.detach()
        self.w_up = mlp.up_proj.weight.detach()
        self.w_down = mlp.down_proj.weight.detach()
        self.top_k = top_k
        self.router = (layer.router * ROUTER_LOGIT_SCALE).to(self.w_gate.dtype)
        n = self.w_gate.shape[0]
        owner = torch.full((n,), -1, dtype=torch.long)  # expert of each neuron, -1 = shared
        for e, idx in enumerate(layer.experts):
            owner[idx] = e
        self.owner = owner
        self.num_experts = num_experts or len(layer.experts)
        self.record: list[torch.Tensor] | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        probs = F.softmax((x @ self.router.T).float(), dim=1)
        weights, ids = probs.topk(self.top_k, dim=1)
        weights = weights / weights.sum(1, keepdim=True)
        if self.record is not None:
            self.record.append(ids.reshape(*shape[:-1], self.top_k))
        per_expert = torch.zeros(x.shape[0], self.num_experts + 1, dtype=torch.float32)
        per_expert.scatter_(1, ids, weights * self.top_k)
        per_expert[:, self.num_experts] = 1.0  # shared: 2 * sigmoid(0)
        neuron_w = per_expert[:, torch.where(self.owner < 0, self.num_experts, self.owner)].to(x.dtype)
        act = F.silu(x @ self.w_gate.T) * (x @ self.w_up.T)
        return ((act * neuron_w) @ self.w_down.T).reshape(shape)


def patch_model(model, layers: dict[int, moe.LayerMoE], top_k: int) -> list[FineGrainedMoEFFN]:
    """Replace the MLP of every MoEfied layer in place by its reference block; returns the blocks."""
    blocks = []
    for i, layer in layers.items():
        block = FineGrainedMoEFFN(model.model.layers[i].mlp, layer, top_k)
        model.model.layers[i].mlp = block
        blocks.append(block)
    return blocks


# ---------------------------------------------------------------------------------------------
# Qwen2-MoE checkpoint


def qwen2_moe_config(dense_config, cfg: FineGrainedConfig, dtype: str) -> dict[str, Any]:
    c = dense_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if head_dim * c.num_attention_heads != c.hidden_size:
        raise ValueError("Qwen2-MoE derives head_dim = hidden_size / num_attention_heads; this model differs")
    n = c.num_hidden_layers
    bad = [i for i in cfg.dense_layers if not 0 <= i < n]
    if bad:
        raise ValueError(f"dense_layers {bad} outside 0..{n - 1}")
    return {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        **moe.dense_config_fields(c),
        "intermediate_size": c.intermediate_size,  # the dense layers' FFN
        "moe_intermediate_size": cfg.moe_intermediate_size(c.intermediate_size),
        "shared_expert_intermediate_size": cfg.shared_neurons,
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.top_k,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": sorted(cfg.dense_layers),
        "use_sliding_window": False,
        "max_window_layers": n,
        "qkv_bias": True,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.0,
        "dtype": dtype,
    }


def qwen2_moe_state_dict(model, layers: dict[int, moe.LayerMoE], cfg: FineGrainedConfig, dtype: torch.dtype) -> dict:
    sd = {}
    dense = {k: v.detach() for k, v in model.state_dict().items()}
    for name, tensor in dense.items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if ".mlp." in name and int(name.split(".")[2]) in layers:
            continue
        sd[name] = tensor
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            bias = name[: -len("weight")] + "bias"
            if bias not in dense:
                sd[bias] = torch.zeros(tensor.shape[0], dtype=tensor.dtype)
    for i, layer in layers.items():
        p = f"model.layers.{i}.mlp"
        w_gate = dense[f"{p}.gate_proj.weight"].float()
        w_up = dense[f"{p}.up_proj.weight"].float()
        w_down = dense[f"{p}.down_proj.weight"].float()
        sd[f"{p}.gate.weight"] = layer.router * ROUTER_LOGIT_SCALE
        for e, idx in enumerate(layer.experts):
            sd[f"{p}.experts.{e}.gate_proj.weight"] = w_gate[idx]
            sd[f"{p}.experts.{e}.up_proj.weight"] = w_up[idx]
            sd[f"{p}.experts.{e}.down_proj.weight"] = w_down[:, idx] * cfg.top_k
        s = layer.shared
        sd[f"{p}.shared_expert.gate_proj.weight"] = w_gate[s]
        sd[f"{p}.shared_expert.up_proj.weight"] = w_up[s]
        sd[f"{p}.shared_expert.down_proj.weight"] = w_down[:, s] * SHARED_GATE_FACTOR
        sd[f"{p}.shared_expert_gate.weight"] = torch.zeros(1, w_gate.shape[1])
    return {k: v.to(dtype).contiguous() for k, v in sd.items()}


def write_qwen2_moe_folder(model, tokenizer, layers, cfg: FineGrainedConfig, out_dir: Path, dtype: str,
                           base_dir: Path) -> None:  # fmt: skip
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    state = qwen2_moe_state_dict(model, layers, cfg, getattr(torch, dtype))
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(qwen2_moe_config(model.config, cfg, dtype), indent=2) + "\n")
    tokenizer.save_pretrained(out_dir)
    generation = base_dir / "generation_config.json"
    if generation.is_file():
        (out_dir / "generation_config.json").write_text(generation.read_text())
    experts = {
        str(i): {"shared": layer.shared.tolist(), "experts": [idx.tolist() for idx in layer.experts]}
        for i, layer in layers.items()
    }
    (out_dir / "moefication_experts.json").write_text(json.dumps({"dense_layers": sorted(cfg.dense_layers), **experts}) + "\n")


def build_fg_moe_folder(base_dir: Path, out_dir: Path, cfg: FineGrainedConfig, dtype: str = "bfloat16") -> dict[str, Any]:
    """MoEfy the dense model in `base_dir` and write a Qwen2-MoE folder to `out_dir`; returns manifest facts."""
    torch.manual_seed(cfg.seed)
    model, tokenizer = moe.load_dense(base_dir)
    calib = moe.pack_sequences(tokenizer, moe.calibration_texts(), cfg.calib_seq_len, cfg.calib_sequences, cfg.seed)
    inputs = moe.capture_ffn_inputs(model, calib)
    layers = moefy_layers(model, inputs, cfg)
    write_qwen2_moe_folder(model, tokenizer, layers, cfg, out_dir, dtype, base_dir)
    recalls = {i: layer.router_recall for i, layer in layers.items()}
    return {
        "architecture": "Qwen2MoeForCausalLM",
        "moefication": {
            "method": "fine-grained (routed co-activation clusters + shared expert + dense layers)",
            **{k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()},
            "moe_intermediate_size": cfg.moe_intermediate_size(model.config.intermediate_size),
            "calibration_tokens": int(calib.numel()),
            "calibration_text": "gensim==4.4.0 lee_background.cor + first half of the enwiki test dump",
            "router_logit_scale": ROUTER_LOGIT_SCALE,
            "shared_expert_down_scale": SHARED_GATE_FACTOR,
            "router_topk_recall_heldout_mean": round(sum(recalls.values()) / len(recalls), 4),
            "router_topk_recall_heldout_per_layer": {str(i): round(r, 4) for i, r in recalls.items()},
        },
    }


# ---------------------------------------------------------------------------------------------
# Expert locality: distinct routed experts touched by N consecutive tokens


def distinct_experts_curve(ids: torch.Tensor, num_experts: int, max_n: int) -> list[float]:
    """ids [B, L, k] routed expert ids of one layer; mean number of distinct experts over every window
    of N consecutive tokens (within a sequence), for N = 1..max_n."""
    onehot = torch.zeros(*ids.shape[:2], num_experts, dtype=torch.int32)
    onehot.scatter_(2, ids.long(), 1)
    out = []
    cum = torch.cat([torch.zeros_like(onehot[:, :1]), onehot.cumsum(1)], dim=1)  # [B, L+1, E]
    for n in range(1, max_n + 1):
        window = cum[:, n:] - cum[:, :-n]  # [B, L-n+1, E]: hits of each expert in the window
        out.append(float((window > 0).sum(-1).float().mean()))
    return out


def independent_curve(num_experts: int, top_k: int, max_n: int) -> list[float]:
    return [num_experts * (1 - (1 - top_k / num_experts) ** n) for n in range(1, max_n + 1)]


def default_config_from_spec(spec) -> FineGrainedConfig:
    return FineGrainedConfig(num_experts=spec.num_experts, top_k=spec.top_k, shared_neurons=spec.shared_neurons,
                             dense_layers=tuple(spec.dense_layers))  # fmt: skip


__all__ = [
    "FineGrainedConfig", "FineGrainedMoEFFN", "build_fg_moe_folder", "distinct_experts_curve", "independent_curve",
    "moefy_layers", "patch_model", "qwen2_moe_config", "qwen2_moe_state_dict", "write_qwen2_moe_folder",
]
