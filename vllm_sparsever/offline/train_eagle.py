"""`vllm-sparsever train-eagle MODEL`: an EAGLE-3 head trained by self-distillation, in vLLM's format.

The target is frozen (Hugging Face transformers, CPU, fp32). Steps:

1. text: the target's own continuations of the calibration prompts, as `train-exits` makes them
   (same options, same cache: `<model>/exit_heads/generated.jsonl`; held-out articles disjoint), or
   with `text="chat"` its answers to chat, math and code prompts (`chat_prompt_rows`; the
   benchmarks' prompts left out);
   with `code_tokens`, chunks of Python source too (data/python_source.py; held-out files disjoint),
   read teacher-forced, which costs a forward pass but no generation.
2. features: one fp32 forward pass of the target per sequence gives, at every position, the
   residual streams vLLM hands an EAGLE-3 head (`aux_layers`: 0 = the embeddings, l = after
   decoder layer l) and the final-normed hidden state (the teacher's logits come from it). They
   are cached in `<model>/eagle3_features/`, one file per text holding every layer computed so
   far, so recipes compared on the same text pay for the forward passes once.
3. training (EAGLE-3's training-time test): the head runs `ttt_steps` steps as it will in vLLM.
   Step 1 at base position s reads token s+1 and the target's streams at s; step k > 1 reads
   token s+k and the head's own output of step k-1. Step 1 attends causally to step 1's keys;
   step k also to its own earlier steps at the same base. Each step is trained towards the
   target's distribution at s+k (KL over the draft vocabulary), on generated positions only
   (`train_positions="all"`: the prompts' positions too; every position of the Python source).
   The LM head starts as the target's rows of the draft vocabulary and stays frozen; the token
   embeddings are the target's (not saved: vLLM shares them). With `feature_scale="rms"` the head
   trains on streams divided per dimension by their RMS over the training text (the later layers'
   streams are several times the early ones', a few dimensions tens of times the rest); the scale
   is folded into `fc` on save, so the saved head reads the raw streams as vLLM hands them. Measured
   worse than the raw streams at equal steps (bench/results/README.md), so not the default.
4. report: per step, the held-out top-1 agreement with the target (the head's token mapped to the
   target's vocabulary against the target's argmax over the full vocabulary), and the mean length
   of the agreeing prefix of a chain of `ttt_steps` (teacher-forced).

Output: `config.json` (architecture `LlamaForCausalLMEagle3`, the aux layer ids, the draft vocabulary
size) and `model.safetensors` (`midlayer.*`, `fc`, `norm`, `lm_head`, and `d2t`/`t2d` when the draft
vocabulary is trimmed), which stock vLLM's `{"method": "eagle3"}` loads; `sparsever_eagle.json` holds
the training record and the held-out agreement.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from vllm_sparsever.data.python_source import LICENSE as PYTHON_SOURCE_LICENSE
from vllm_sparsever.data.python_source import python_source_chunks
from vllm_sparsever.offline.train_exits import (
    GENERATED_NAME,
    TrainExitsError,
    TrainExitsOptions,
    _lr_at,
    eos_token_ids,
    load_target,
    read_config,
    resolve_model_dir,
    split_prompts,
    target_text,
)

HEAD_DIRNAME = "eagle3_head"
MANIFEST_NAME = "sparsever_eagle.json"
ARCHITECTURE = "LlamaForCausalLMEagle3"
# Targets whose layer outputs vLLM's EAGLE-3 drafter reads (their vLLM classes support EAGLE-3).
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
# Later steps weigh less: a chain stops at its first rejected draft.
STEP_WEIGHT_DECAY = 0.8
TRAIN_POSITIONS = ("generated", "all")
FEATURE_SCALES = ("rms", "none")
FEATURES_DIRNAME = "eagle3_features"
DEFAULT_MAX_INTERMEDIATE = 2048
CODE_CHUNK_TOKENS = 512
TEXTS = ("calibration", "chat")
# text="chat": the target's answers to chat, math and code prompts. Each category's first
# EVALUATION_PROMPTS are the benchmarks' prompts (bench/drafters.py takes the first few), never trained on.
CHAT_CATEGORIES = ("mt_bench", "gsm8k", "humaneval")
EVALUATION_PROMPTS = 16
CHAT_GENERATED_NAME = "generated_chat.jsonl"
# text="chat"'s own defaults, the measured run (bench/results/README.md): its pool of prompts is large,
# so one answer per prompt and fewer passes; generating the answers is the largest part of the hour.
CHAT_DEFAULTS = {"num_prompts": 150, "samples_per_prompt": 1, "max_new_tokens": 320, "epochs": 3,
                 "time_budget_min": 65.0}


class TrainEagleError(TrainExitsError):
    """train-eagle cannot run as asked (names the flag and the allowed values)."""


@dataclass
class TrainEagleOptions:
    aux_layers: tuple[int, ...] | None = None  # None: (2, L/2, L), spread on small targets
    # The head's size: on a CPU's hour, a smaller head's cheaper steps teach it more (bench/results/README.md).
    draft_vocab: int | None = 8192  # the N most frequent tokens of the training text; None: all
    intermediate_size: int | None = None  # the head's MLP width; None: the target's, at most 2048
    ttt_steps: int = 3
    text: str = "calibration"  # or "chat": answers to chat, math and code prompts (CHAT_CATEGORIES)
    samples_per_prompt: int = 4  # continuations sampled per training prompt (the data set is small)
    train_positions: str = "all"  # or "generated": the generated tokens only (the prompts are teacher-forced)
    code_tokens: int = 0  # Python source chunks added to the training text (data/python_source.py)
    code_heldout_tokens: int = 4096  # held-out Python source, from other files (with code_tokens > 0)
    num_prompts: int | None = None
    num_heldout_prompts: int = 8
    max_prompt_tokens: int = 256
    max_new_tokens: int = 384
    min_new_tokens: int = 0
    temperature: float = 0.7
    seed: int = 0
    epochs: int = 5
    lr: float = 2e-3
    weight_decay: float = 0.0
    feature_scale: str = "none"  # or "rms": streams scaled per dimension while training (module docstring)
    time_budget_min: float = 55.0  # the whole job; training stops early to stay inside it
    generator: str = "vllm"
    generation_dtype: str = "auto"  # see train_exits.generation_dtype_here
    regenerate: bool = False
    output_dir: str | None = None  # None: <model>/eagle3_head
    show_progress: bool = True
    prompt_rows: list[dict[str, Any]] | None = field(default=None, repr=False)

    @classmethod
    def for_text(cls, text: str = "calibration", **given: Any) -> TrainEagleOptions:
        """Options for `text` (one of TEXTS): the text's own defaults where `given` leaves a field unset."""
        return cls(text=text, **{**(CHAT_DEFAULTS if text == "chat" else {}), **given})

    def text_options(self) -> TrainExitsOptions:
        """The text part, as train-exits has it (so both share the cached text)."""
        names = ("num_prompts", "num_heldout_prompts", "max_prompt_tokens", "max_new_tokens", "min_new_tokens",
                 "temperature", "seed", "generator", "generation_dtype", "regenerate", "show_progress", "prompt_rows")
        return TrainExitsOptions(**{n: getattr(self, n) for n in names})


def head_dir(model_dir: str | Path) -> Path:
    return Path(model_dir) / HEAD_DIRNAME


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """(2, L/2, L) where that names three distinct layers, else three spread over 0..L. vLLM's own
    default is (2, L/2, L-3); the last layer's output, which vLLM hands a head as well, taught the
    heads trained here more at equal steps (bench/results/README.md)."""
    layers = (2, num_layers // 2, num_layers)
    if len(set(layers)) == 3 and min(layers) >= 0:
        return layers
    return tuple(sorted({round(i * num_layers / 2) for i in range(3)}))


def validate(options: TrainEagleOptions, config: dict[str, Any]) -> tuple[int, ...]:
    """The aux layers; every bad option as a TrainEagleError naming its flag."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise TrainEagleError(f"MODEL: vLLM's EAGLE-3 drafter reads the layer outputs of model types "
                              f"{', '.join(SUPPORTED_MODEL_TYPES)}; this model is {model_type!r}")
    layers = int(config["num_hidden_layers"])
    aux = tuple(options.aux_layers) if options.aux_layers else default_aux_layers(layers)
    if len(aux) < 1 or any(not 0 <= a <= layers for a in aux) or list(aux) != sorted(set(aux)):
        raise TrainEagleError(f"--aux-layers: increasing distinct layer ids in 0..{layers} (0 = the embeddings), "
                              f"got {list(aux)}")
    vocab = int(config["vocab_size"])
    if options.draft_vocab is not None and not 1 <= options.draft_vocab:
        raise TrainEagleError(f"--draft-vocab: at least 1 (at most the vocabulary, {vocab}), got {options.draft_vocab}")
    if options.feature_scale not in FEATURE_SCALES:
        raise TrainEagleError(f"--feature-scale: one of {', '.join(FEATURE_SCALES)}, got {options.feature_scale!r}")
    if options.text not in TEXTS:
        raise TrainEagleError(f"--text: one of {', '.join(TEXTS)}, got {options.text!r}")
    if options.train_positions not in TRAIN_POSITIONS:
        raise TrainEagleError(f"--train-positions: one of {', '.join(TRAIN_POSITIONS)}, got {options.train_positions!r}")
    for flag, value in (("--code-tokens", options.code_tokens), ("--code-heldout-tokens", options.code_heldout_tokens)):
        if value < 0:
            raise TrainEagleError(f"{flag}: at least 0, got {value}")
    for flag, value in (("--ttt-steps", options.ttt_steps), ("--epochs", options.epochs),
                        ("--samples-per-prompt", options.samples_per_prompt)):
        if value < 1:
            raise TrainEagleError(f"{flag}: at least 1, got {value}")
    if options.intermediate_size is not None and options.intermediate_size < 1:
        raise TrainEagleError(f"--intermediate-size: at least 1, got {options.intermediate_size}")
    if options.lr <= 0:
        raise TrainEagleError(f"--lr: greater than 0, got {options.lr}")
    if options.time_budget_min <= 0:
        raise TrainEagleError(f"--time-budget: must be > 0 minutes, got {options.time_budget_min}")
    return aux


# ---- the head ----------------------------------------------------------------------------------


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
                      rotary=_rotary(target_config, config["head_dim"]), lm_head=weights["lm_head.weight"])
    saved = head.state_for_vllm()
    head.load_state_dict({name: weights[saved_name] for (name, _), saved_name
                          in zip(head.named_parameters(), [k for k in saved if k != "lm_head.weight"], strict=True)})
    draft_ids = torch.arange(config["draft_vocab_size"])
    if "d2t" in weights:
        draft_ids = draft_ids + weights["d2t"]
    return head.eval(), aux, draft_ids


# ---- features ----------------------------------------------------------------------------------


@dataclass
class Sequence:
    tokens: torch.Tensor  # [T] prompt + generated
    aux: torch.Tensor  # [T, num_aux * hidden] (bf16 to halve the memory)
    final: torch.Tensor  # [T, hidden] the final-normed hidden state (bf16)
    target_argmax: torch.Tensor  # [T] the target's full-vocabulary argmax
    first: int  # the first position whose next token was generated (the prompt's last)


def extract_features(model, seqs: list[dict[str, Any]], aux_layers: tuple[int, ...], desc: str,
                     show_progress: bool, all_positions: bool = False) -> list[Sequence]:
    """One fp32 forward pass per sequence. Trained (and evaluated) positions: those whose next token
    was generated, or with `all_positions` every position."""
    from tqdm.auto import tqdm

    body = model.model
    captured: dict[int, torch.Tensor] = {}

    def keep(layer_id: int):
        def hook(_module, _inputs, output):
            captured[layer_id] = (output[0] if isinstance(output, tuple) else output)[0].float()
        return hook

    handles = [body.embed_tokens.register_forward_hook(keep(0))] if 0 in aux_layers else []
    handles += [body.layers[a - 1].register_forward_hook(keep(a)) for a in aux_layers if a > 0]
    lm_head = model.get_output_embeddings().weight
    out: list[Sequence] = []
    try:
        for seq in tqdm(seqs, desc=desc, disable=not show_progress):
            prompt, gen = seq["prompt_ids"], seq["generated_ids"]
            if not gen:
                continue
            ids = torch.tensor([prompt + gen])
            with torch.inference_mode():
                final = body(input_ids=ids).last_hidden_state[0].float()
                argmax = (final @ lm_head.T).argmax(-1)
            aux = torch.cat([captured[a] for a in aux_layers], dim=-1)
            out.append(Sequence(ids[0].clone(), aux.to(torch.bfloat16), final.to(torch.bfloat16), argmax.clone(),
                                0 if all_positions else len(prompt) - 1))
    finally:
        for h in handles:
            h.remove()
    if not out:
        raise TrainEagleError("no generated tokens to train on (every generation was empty)")
    return out


def cached_features(model_dir: str | Path, model, seqs: list[dict[str, Any]], aux_layers: tuple[int, ...], desc: str,
                    show_progress: bool, all_positions: bool = False) -> list[Sequence]:
    """`extract_features`, cached in `<model>/eagle3_features/`: one file per text (a key of the
    target's weights file and every sequence's tokens) holding the layers computed so far. Layers
    already there are read back; others are computed together with them (`model` runs only then)
    and the file rewritten with the union, so recipes over other layers share one file."""
    import hashlib
    import pickle

    weights = Path(model_dir) / "model.safetensors"
    stat = weights.stat() if weights.exists() else None
    key = hashlib.sha256(json.dumps({
        "weights": [stat.st_size, int(stat.st_mtime)] if stat else None,
        "seqs": [[s.get("id"), s["prompt_ids"], s["generated_ids"]] for s in seqs]}).encode()).hexdigest()[:20]
    path = Path(model_dir) / FEATURES_DIRNAME / f"{key}.pt"
    stored = None
    if path.exists():
        try:
            stored = torch.load(path, weights_only=True)
            stored = (tuple(stored["layers"]), [Sequence(**row) for row in stored["seqs"]])
        except (OSError, RuntimeError, KeyError, TypeError, pickle.UnpicklingError):  # unreadable or older: recompute
            stored = None
    if stored is None or not set(aux_layers) <= set(stored[0]):
        layers = tuple(sorted(set(aux_layers) | set(stored[0] if stored else ())))
        stored = (layers, extract_features(model, seqs, layers, desc, show_progress))
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_suffix(".partial")
        torch.save({"layers": list(layers), "seqs": [asdict(s) for s in stored[1]]}, part)
        part.replace(path)
    return select_layers(stored[1], stored[0], aux_layers, all_positions)


def select_layers(seqs: list[Sequence], layers: tuple[int, ...], wanted: tuple[int, ...],
                  all_positions: bool = False) -> list[Sequence]:
    """The sequences' streams of the `wanted` layers (a subset of their `layers`, in that order);
    with `all_positions` every position trained (`first` = 0)."""
    if tuple(wanted) == tuple(layers) and not all_positions:
        return seqs
    idx = [layers.index(a) for a in wanted]
    out = []
    for s in seqs:
        t = s.aux.shape[0]
        aux = s.aux.view(t, len(layers), -1)[:, idx].reshape(t, -1)
        out.append(Sequence(s.tokens, aux, s.final, s.target_argmax, 0 if all_positions else s.first))
    return out


def stream_rms(seqs: list[Sequence]) -> torch.Tensor:
    """Per dimension of the concatenated streams, the RMS over every position but the first (the
    attention sink's streams are a hundred times the rest)."""
    total = sum(s.aux[1:].float().pow(2).sum(0) for s in seqs)
    count = sum(max(0, s.aux.shape[0] - 1) for s in seqs)
    return (total / max(1, count)).sqrt().clamp(min=1e-6)


# ---- training and evaluation -------------------------------------------------------------------


def _step_targets(seq: Sequence, k: int) -> torch.Tensor:
    """Base positions s whose step-k prediction is trained and evaluated: s + k is a position
    whose next token was generated (p = s + k in [first, T-1])."""
    t = seq.tokens.shape[0]
    return torch.arange(max(0, seq.first - k), t - k)


def _teacher_logp(seq: Sequence, positions: torch.Tensor, draft_lm_head: torch.Tensor) -> torch.Tensor:
    return F.log_softmax(seq.final[positions].float() @ draft_lm_head.T, dim=-1)


def train_head(head: Eagle3Head, embed: nn.Module, train: list[Sequence], options: TrainEagleOptions,
               deadline: float) -> tuple[int, int, bool, list[float]]:
    """(steps done, steps planned, stopped by the time budget, mean loss per epoch). One sequence
    per step."""
    from tqdm.auto import tqdm

    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=options.lr, weight_decay=options.weight_decay)
    planned = len(train) * options.epochs
    generator = torch.Generator().manual_seed(options.seed)
    weights = [STEP_WEIGHT_DECAY ** k for k in range(options.ttt_steps)]
    step, stopped, epoch_loss = 0, False, []
    bar = tqdm(total=planned, desc="train", disable=not options.show_progress)
    head.train()
    for _epoch in range(options.epochs):
        total, count = 0.0, 0
        for i in torch.randperm(len(train), generator=generator).tolist():
            if time.monotonic() >= deadline:
                stopped = True
                break
            seq = train[i]
            lr = _lr_at(step, planned, options.lr)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.zero_grad(set_to_none=True)
            logits = head.chain(embed, seq.tokens, seq.aux.float(), options.ttt_steps)
            # Every step's targets are positions first..T-1 (step k's bases shifted by k): one teacher.
            teacher_all = _teacher_logp(seq, torch.arange(seq.first, seq.tokens.shape[0]), head.lm_head)
            loss = torch.zeros(())
            for k, step_logits in enumerate(logits, start=1):
                bases = _step_targets(seq, k)
                if len(bases) == 0:
                    continue
                teacher = teacher_all[bases + k - seq.first]
                student = F.log_softmax(step_logits[bases], dim=-1)
                loss = loss + weights[k - 1] * (teacher.exp() * (teacher - student)).sum(-1).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            total += float(loss.detach())
            count += 1
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}", lr=f"{lr:.1e}")
        if count:
            epoch_loss.append(total / count)
        if stopped:
            break
    bar.close()
    head.eval()
    return step, planned, stopped, epoch_loss


@torch.no_grad()
def evaluate(head: Eagle3Head, embed: nn.Module, seqs: list[Sequence], steps: int,
             draft_ids: torch.Tensor) -> dict[str, Any]:
    """Per step the top-1 agreement with the target (full vocabulary), and the mean agreeing
    prefix of a `steps`-draft chain per base position (teacher-forced)."""
    agree = [0] * steps
    seen = [0] * steps
    prefix_sum, bases_seen = 0, 0
    for seq in seqs:
        logits = head.chain(embed, seq.tokens, seq.aux.float(), steps)
        hits = []
        for k, step_logits in enumerate(logits, start=1):
            drafted = draft_ids[step_logits.argmax(-1)]
            positions = torch.arange(step_logits.shape[0]) + k
            ok = drafted == seq.target_argmax[positions.clamp(max=seq.tokens.shape[0] - 1)]
            bases = _step_targets(seq, k)
            agree[k - 1] += int(ok[bases].sum())
            seen[k - 1] += len(bases)
            hits.append(ok)
        # Chains whose every step has a target: bases whose last step's position exists.
        full = _step_targets(seq, steps)
        if len(full):
            run = torch.ones(len(full), dtype=torch.long)
            length = torch.zeros(len(full), dtype=torch.long)
            for ok in hits:
                run = run * ok[full].long()
                length += run
            prefix_sum += int(length.sum())
            bases_seen += len(full)
    return {"agreement_per_step": [round(a / max(1, n), 4) for a, n in zip(agree, seen)],
            "mean_accepted_prefix": round(prefix_sum / max(1, bases_seen), 4), "positions": seen[0]}


# ---- the job -----------------------------------------------------------------------------------


@dataclass
class TrainEagleResult:
    model_dir: str
    output_dir: Path
    before: dict[str, Any]
    after: dict[str, Any]
    train_tokens: int
    heldout_tokens: int
    steps: int
    planned_steps: int
    stopped_by_budget: bool
    seconds: dict[str, float]
    code: dict[str, Any] | None = None  # held-out Python source: {"untrained": ..., "trained": ...}


def _rotary(config: dict[str, Any], head_dim: int) -> nn.Module:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    keys = ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings")
    return LlamaRotaryEmbedding(LlamaConfig(hidden_size=config["hidden_size"], head_dim=head_dim,
                                            num_attention_heads=config["num_attention_heads"],
                                            **{k: config[k] for k in keys if config.get(k) is not None}))


def _interleave(pools: list[list[dict]]) -> list[dict]:
    return [pool[i] for i in range(max(map(len, pools), default=0)) for pool in pools if i < len(pool)]


def chat_prompt_rows(num_heldout: int) -> list[dict]:
    """The prompts of text="chat": each of CHAT_CATEGORIES after its first EVALUATION_PROMPTS,
    interleaved so that `--num-prompts` takes from every category; the held-out prompts (the
    next few of each category) last, where `split_prompts` takes them."""
    from vllm_sparsever.data import load_prompts

    pools = []
    for category in CHAT_CATEGORIES:
        try:
            rows = load_prompts(category)[EVALUATION_PROMPTS:]
        except FileNotFoundError as exc:  # DataNotBuiltError names the build command
            raise TrainEagleError(f"--text chat: {exc}") from None
        pools.append([{"id": f"{category}:{r['id']}", "prompt": r["prompt"]} for r in rows])
    per_category = -(-num_heldout // len(pools))
    heldout = _interleave([pool[:per_category] for pool in pools])[:num_heldout]
    return _interleave([pool[per_category:] for pool in pools]) + heldout


def text_rows(options: TrainEagleOptions) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows) of the generated text: several sampled continuations per
    training prompt, one per held-out prompt. The generated text's cache is keyed by exactly these."""
    text_options = options.text_options()
    if options.text == "chat" and options.prompt_rows is None:
        text_options.prompt_rows = chat_prompt_rows(options.num_heldout_prompts)
    train_rows, heldout_rows = split_prompts(text_options)
    return ([{**row, "id": f"{row['id']}#{k}"} if k else row
             for row in train_rows for k in range(options.samples_per_prompt)], heldout_rows)


class GeneratedText(NamedTuple):
    train_rows: list[dict]
    heldout_rows: list[dict]
    train: list[dict]  # the training rows' sequences (prompt_ids, generated_ids)
    heldout: list[dict]
    model: Any  # the target, if generating the text loaded it; else None


def generated_text(model_dir: str, options: TrainEagleOptions) -> GeneratedText:
    """train-eagle's text for `options`: the target's continuations of `text_rows`, generated once
    and cached in `<model>/exit_heads/` (the calibration text's file is shared with train-exits)."""
    from vllm_sparsever.drafting.exit_head import heads_dir

    train_rows, heldout_rows = text_rows(options)
    name = CHAT_GENERATED_NAME if options.text == "chat" else GENERATED_NAME
    seqs, model = target_text(model_dir, train_rows + heldout_rows, options.text_options(), heads_dir(model_dir) / name)
    held = {r["id"] for r in heldout_rows}
    return GeneratedText(train_rows, heldout_rows, [s for s in seqs if s["id"] not in held],
                         [s for s in seqs if s["id"] in held], model)


def train_eagle(model: str, options: TrainEagleOptions | None = None) -> TrainEagleResult:
    options = options or TrainEagleOptions()
    start = time.monotonic()
    deadline = start + options.time_budget_min * 60.0
    model_dir = resolve_model_dir(model)
    config = read_config(model_dir)
    aux_layers = validate(options, config)
    output_dir = Path(options.output_dir) if options.output_dir else head_dir(model_dir)
    torch.manual_seed(options.seed)
    seconds: dict[str, float] = {}

    t0 = time.monotonic()
    text = generated_text(model_dir, options)
    train_rows, heldout_rows, train_seqs, hf_model = text.train_rows, text.heldout_rows, text.train, text.model
    seconds["generate"] = time.monotonic() - t0
    all_positions = options.train_positions == "all"
    code_train, code_heldout = python_code(model_dir, options)

    t0 = time.monotonic()
    if hf_model is None:
        hf_model, _ = load_target(model_dir)
    features = partial(cached_features, model_dir, hf_model, aux_layers=aux_layers, show_progress=options.show_progress)
    train = features(train_seqs, desc="features (train)", all_positions=all_positions)
    generated_tokens = sum(len(s.tokens) - s.first for s in train)
    train += features(code_train, desc="features (code)", all_positions=True) if code_train else []
    heldout = features(text.heldout, desc="features (held-out)")
    heldout_code = features(code_heldout, desc="features (held-out code)", all_positions=True) if code_heldout else []
    seconds["features"] = time.monotonic() - t0

    vocab = int(config["vocab_size"])
    draft_ids = draft_vocabulary(
        [s["prompt_ids"] + s["generated_ids"] if all_positions else s["generated_ids"] for s in train_seqs]
        + [s["generated_ids"] for s in code_train], vocab, options.draft_vocab, eos_token_ids(hf_model.generation_config))
    intermediate = options.intermediate_size or min(DEFAULT_MAX_INTERMEDIATE, int(config["intermediate_size"]))
    head = new_head(config, len(aux_layers), intermediate,
                    hf_model.get_output_embeddings().weight.detach().float()[draft_ids])
    if options.feature_scale == "rms":
        head.aux_inv_scale.copy_(1.0 / stream_rms(train))
    embed = hf_model.get_input_embeddings().float().requires_grad_(False)
    del hf_model

    t0 = time.monotonic()
    before = evaluate(head, embed, heldout, options.ttt_steps, draft_ids)
    code = {"untrained": evaluate(head, embed, heldout_code, options.ttt_steps, draft_ids)} if heldout_code else None
    seconds["evaluate"] = time.monotonic() - t0
    t0 = time.monotonic()
    steps, planned, stopped, epoch_loss = train_head(head, embed, train, options,
                                                     deadline - 1.5 * seconds["evaluate"] - 5.0)
    seconds["train"] = time.monotonic() - t0
    t0 = time.monotonic()
    after = evaluate(head, embed, heldout, options.ttt_steps, draft_ids)
    if code is not None:
        code["trained"] = evaluate(head, embed, heldout_code, options.ttt_steps, draft_ids)
    seconds["evaluate"] += time.monotonic() - t0

    save_head(output_dir, head, draft_ids, config, aux_layers)
    seconds["total"] = time.monotonic() - start
    record = {
        "tool": "vllm-sparsever train-eagle",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "target": {"model_dir": model_dir, "architecture": config["architectures"][0],
                   "num_hidden_layers": int(config["num_hidden_layers"])},
        "settings": {**{k: v for k, v in asdict(options).items() if k not in ("prompt_rows", "output_dir")},
                     "aux_layers": list(aux_layers), "draft_vocab_size": len(draft_ids),
                     "intermediate_size": intermediate},
        "data": {"train_ids": [r["id"] for r in train_rows], "heldout_ids": [r["id"] for r in heldout_rows],
                 "positions": ("every position of the generated sequences (prompts teacher-forced)" if all_positions
                               else "generated tokens only"),
                 "train_tokens_generated_text": generated_tokens,
                 "code": {"source": PYTHON_SOURCE_LICENSE, "positions": "every position (teacher-forced)",
                          "train_files": [s["id"] for s in code_train],
                          "heldout_files": [s["id"] for s in code_heldout]} if code_train or code_heldout else None},
        "loss": "KL(target || head) over the draft vocabulary per training-time-test step, weights "
                f"{STEP_WEIGHT_DECAY}^(k-1); LM head frozen (the target's rows), embeddings the target's",
        "train_tokens": sum(len(s.tokens) - s.first for s in train),
        "heldout_tokens": sum(len(s.tokens) - s.first for s in heldout),
        "steps": steps, "planned_steps": planned, "stopped_by_time_budget": stopped,
        "train_loss_per_epoch": [round(v, 4) for v in epoch_loss],
        "heldout": {"untrained": before, "trained": after},
        "heldout_code": code,
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
        "torch": torch.__version__, "threads": torch.get_num_threads(),
    }
    (output_dir / MANIFEST_NAME).write_text(json.dumps(record, indent=1) + "\n")
    return TrainEagleResult(model_dir=model_dir, output_dir=output_dir, before=before, after=after,
                            train_tokens=record["train_tokens"], heldout_tokens=record["heldout_tokens"],
                            steps=steps, planned_steps=planned, stopped_by_budget=stopped, seconds=seconds,
                            code=code)


def draft_vocabulary(texts: list[list[int]], vocab: int, size: int | None, always: list[int]) -> torch.Tensor:
    """The draft vocabulary, in id order: the `size` most frequent tokens of `texts` (`always`
    first; then the lowest unused ids if the texts have fewer), or the whole vocabulary."""
    from vllm_sparsever.drafting.draft_vocab import rank_tokens

    if size is None or size >= vocab:
        return torch.arange(vocab)
    ranked = rank_tokens(texts, always=always)
    extra = torch.tensor([t for t in range(vocab) if t not in set(ranked.tolist())], dtype=torch.long)
    return torch.cat([ranked, extra])[:size].sort().values


def new_head(config: dict[str, Any], num_aux: int, intermediate: int, lm_head: torch.Tensor) -> Eagle3Head:
    """An untrained head for the target `config`, its LM head `lm_head` (the draft vocabulary's rows)."""
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    return Eagle3Head(hidden=hidden, heads=heads, kv_heads=int(config.get("num_key_value_heads") or heads),
                      head_dim=head_dim, intermediate=intermediate, num_aux=num_aux,
                      eps=float(config.get("rms_norm_eps", 1e-6)), rotary=_rotary(config, head_dim), lm_head=lm_head)


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


def python_code(model_dir: str, options: TrainEagleOptions) -> tuple[list[dict], list[dict]]:
    """(training, held-out) Python source chunks as sequences (a one-token prompt), none without
    `code_tokens`."""
    if not options.code_tokens:
        return [], []
    from transformers import AutoTokenizer

    train, heldout = python_source_chunks(AutoTokenizer.from_pretrained(model_dir), options.code_tokens,
                                          options.code_heldout_tokens, CODE_CHUNK_TOKENS, seed=options.seed)
    as_seq = lambda c: {"id": f"code:{c['id']}", "prompt_ids": c["token_ids"][:1],  # noqa: E731
                        "generated_ids": c["token_ids"][1:]}
    return [as_seq(c) for c in train], [as_seq(c) for c in heldout]


def summary(result: TrainEagleResult) -> str:
    per_step = lambda r: " ".join(f"{a:.3f}" for a in r["agreement_per_step"])  # noqa: E731
    return "\n".join([
        f"EAGLE-3 head for {result.model_dir} -> {result.output_dir}",
        f"tokens: train {result.train_tokens}, held-out {result.heldout_tokens}; steps "
        f"{result.steps}/{result.planned_steps}" + (" (stopped by --time-budget)" if result.stopped_by_budget else ""),
        "seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in result.seconds.items()),
        "held-out top-1 agreement with the target per draft step (teacher-forced):",
        f"  untrained: {per_step(result.before)}  (mean accepted prefix {result.before['mean_accepted_prefix']:.2f})",
        f"  trained:   {per_step(result.after)}  (mean accepted prefix {result.after['mean_accepted_prefix']:.2f})",
        *([f"held-out Python source: untrained {per_step(result.code['untrained'])}, trained "
           f"{per_step(result.code['trained'])}  (mean accepted prefix "
           f"{result.code['trained']['mean_accepted_prefix']:.2f})"] if result.code else []),
        f"use it: --speculative-config '{{\"method\": \"sparsever\", \"draft_source\": \"eagle3\", "
        f"\"model\": \"{result.output_dir}\", \"num_speculative_tokens\": 3}}'",
    ])
