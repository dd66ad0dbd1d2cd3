"""Tiny random Hugging Face models generated on the fly (no hub), for engine tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# A small word-level vocabulary is enough for engine tests; a real tokenizer is needed by vLLM.
_VOCAB_WORDS = [f"w{i}" for i in range(480)]


# transformers 5 loads a `qwen2` model's tokenizer as Qwen2Tokenizer whatever the folder says: byte-level
# BPE from the vocabulary, no merges, so a word is spelled by its bytes. These make the words spellable.
QWEN2_SPELLING = ["\u0120", "w", *"0123456789"]  # "\u0120": byte-level's space


def _write_tokenizer(path: Path, extra: list[str] = ()) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for w in [*_VOCAB_WORDS, *extra]:
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    # Plain concatenation: enough for the chat endpoints to work on the word-level vocabulary.
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(path)


def _fresh(path: Path, hidden_size: int, num_heads: int, seed: int) -> bool:
    """False when `path` already holds a model; else checks the CPU backend's head size and seeds."""
    if (path / "config.json").exists():
        return False
    assert hidden_size // num_heads >= 32, "vLLM's CPU attention needs head_dim >= 32"
    torch.manual_seed(seed)
    return True


def make_tiny_llama(
    path: Path,
    *,
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    max_position_embeddings: int = 2048,
    perturb_from: Path | None = None,
    perturb_scale: float = 0.0,
) -> Path:
    """A random LlamaForCausalLM with head_dim = hidden/heads (>= 32 for the CPU backend)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    if not _fresh(path, hidden_size, num_heads, seed):
        return path
    config = LlamaConfig(
        vocab_size=len(_VOCAB_WORDS) + 3,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    if perturb_from is not None:
        # A draft that mostly agrees with its target: the target's weights plus noise.
        base = LlamaForCausalLM.from_pretrained(perturb_from, torch_dtype=torch.float32)
        with torch.no_grad():
            model.load_state_dict(base.state_dict())
            for p in model.parameters():
                p.add_(torch.randn_like(p) * perturb_scale)
        return save_model(model, path, random_init=False)
    return save_model(model, path)


def make_tiny_qwen2(path: Path, *, seed: int = 0, hidden_size: int = 128, num_layers: int = 2, num_heads: int = 4,
                    num_kv_heads: int = 2, intermediate_size: int = 256, max_position_embeddings: int = 2048) -> Path:
    """A random Qwen2ForCausalLM (biases on q/k/v; otherwise as `make_tiny_llama`; its tokenizer
    spells words byte by byte, see QWEN2_SPELLING)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = Path(path)
    if not _fresh(path, hidden_size, num_heads, seed):
        return path
    config = Qwen2Config(
        vocab_size=len(_VOCAB_WORDS) + 3 + len(QWEN2_SPELLING), hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, use_sliding_window=False, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False, torch_dtype="float32",
    )
    return save_model(Qwen2ForCausalLM(config), path, tokenizer_extra=QWEN2_SPELLING)


def make_tiny_mimo(path: Path, *, seed: int = 0, num_layers: int = 2) -> Path:
    """A random MiMo (vLLM's `MiMoForCausalLM`: a Qwen2 whose checkpoint also holds a
    multi-token-prediction layer, `model.mtp_layers.0.*`, which vLLM's `mtp` method drafts with):
    `make_tiny_qwen2` plus one random MTP layer and `num_nextn_predict_layers: 1`."""
    from safetensors.torch import load_file, save_file

    path = make_tiny_qwen2(Path(path), seed=seed, num_layers=num_layers)
    config = json.loads((path / "config.json").read_text())
    if config.get("num_nextn_predict_layers"):
        return path
    hidden = config["hidden_size"]
    prefix = "model.mtp_layers.0"
    head_dim = hidden // config["num_attention_heads"]
    shapes = {f"{prefix}.{norm}.weight": (hidden,)
              for norm in ("token_layernorm", "hidden_layernorm", "final_layernorm", "input_layernorm")}
    shapes |= {f"{prefix}.input_proj.weight": (hidden, 2 * hidden), **_eagle_layer_shapes(prefix, config, hidden)}
    shapes |= {f"{prefix}.self_attn.{p}_proj.bias": (n * head_dim,)
               for p, n in (("q", config["num_attention_heads"]), ("k", config["num_key_value_heads"]),
                            ("v", config["num_key_value_heads"]))}
    torch.manual_seed(seed + 7)
    mtp = {name: (torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape) * 0.08)
           for name, shape in shapes.items()}
    save_file({**load_file(str(path / "model.safetensors")), **mtp}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    config.update(architectures=["MiMoForCausalLM"], num_nextn_predict_layers=1)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def save_model(model, path: Path, *, random_init: bool = True, tokenizer_extra: list[str] = ()) -> Path:
    """Save a tiny HF model with the word tokenizer. `random_init`: weights ~ N(0, 0.08), larger
    than the default init so greedy outputs are not all one token (and MoE routing not uniform)."""
    if random_init:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    _write_tokenizer(path, tokenizer_extra)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return path


def prompts(n: int, length: int = 12, seed: int = 0) -> list[str]:
    """Prompts with repeated phrases, so n-gram drafting finds matches."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 60, (length,), generator=g).tolist()
        words = [_VOCAB_WORDS[i] for i in ids]
        out.append(" ".join(words + words[: length // 2]))
    return out


def make_tiny_exit_llama(path: Path, *, seed: int = 0, num_layers: int = 6, logit_scale: float = 4.0) -> Path:
    """A tiny random Llama whose next-token distributions are peaked (RMSNorm weights 1, LM head
    scaled so logits have std ~`logit_scale`) and whose residual stream changes from layer to layer:
    early exits then disagree with the final layer in a way a head can learn (early-exit tests).
    The default tiny models' N(0, 0.08) norms make every distribution nearly uniform."""
    from transformers import LlamaForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    make_tiny_llama(path, seed=seed, num_layers=num_layers)
    model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
        head = model.lm_head.weight
        head.copy_(torch.randn(head.shape, generator=g) * logit_scale / head.shape[1] ** 0.5)
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_padded_llama(path: Path, base: Path, *, extra_layers: int, seed: int = 0) -> Path:
    """`base` (a tiny Llama) with `extra_layers` more decoder layers whose outputs are zero (o_proj and
    down_proj zero, the rest random): the same next-token distributions as `base`, exactly in fp32
    (each extra layer adds 0 to the residual stream), at the cost of a deeper model. Pairs of these
    give drafters that are always right and cheap or costly next to their target."""
    from transformers import LlamaForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    small = LlamaForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    config = small.config
    config.num_hidden_layers += extra_layers
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.08)
        model.load_state_dict(small.state_dict(), strict=False)
        for layer in model.model.layers[len(small.model.layers):]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return save_model(model, path, random_init=False)


def _eagle_layer_shapes(prefix: str, config: dict, attention_input: int) -> dict[str, tuple[int, ...]]:
    """One Llama decoder layer's weight shapes, its attention reading `attention_input` features."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads, inter = config.get("num_key_value_heads", heads), config["intermediate_size"]
    head_dim = hidden // heads
    return {
        f"{prefix}.self_attn.q_proj.weight": (heads * head_dim, attention_input),
        f"{prefix}.self_attn.k_proj.weight": (kv_heads * head_dim, attention_input),
        f"{prefix}.self_attn.v_proj.weight": (kv_heads * head_dim, attention_input),
        f"{prefix}.self_attn.o_proj.weight": (hidden, heads * head_dim),
        f"{prefix}.post_attention_layernorm.weight": (hidden,),
        f"{prefix}.mlp.gate_proj.weight": (inter, hidden), f"{prefix}.mlp.up_proj.weight": (inter, hidden),
        f"{prefix}.mlp.down_proj.weight": (hidden, inter),
    }


def _head_config(target_config: dict, architecture: str, **extra) -> dict:
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
            "max_position_embeddings", "rms_norm_eps", "rope_theta")
    return {"architectures": [architecture], "model_type": "llama", "num_hidden_layers": 1, "hidden_act": "silu",
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
            **{k: target_config[k] for k in keys if k in target_config}, **extra}


def _save_head(path: Path, shapes: dict[str, tuple[int, ...]], config: dict, extra: dict | None = None) -> Path:
    from safetensors.torch import save_file

    tensors = {name: (torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape) * 0.08)
               for name, shape in shapes.items()}
    path.mkdir(parents=True, exist_ok=True)
    save_file({**tensors, **(extra or {})}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def make_tiny_eagle(path: Path, target: Path, *, seed: int = 0) -> Path:
    """A random EAGLE (EAGLE-1) head for `target` in the EAGLE repository's format, which vLLM's
    `eagle` method loads: `fc` over [token embedding; target hidden state], one decoder layer
    `layers.0.*` without its input norm; the target's LM head and embeddings are shared."""
    path = Path(path)
    target_config = json.loads((Path(target) / "config.json").read_text())
    hidden = target_config["hidden_size"]
    if not _fresh(path, hidden, target_config["num_attention_heads"], seed):
        return path
    shapes = {"fc.weight": (hidden, 2 * hidden), **_eagle_layer_shapes("layers.0", target_config, hidden)}
    return _save_head(path, shapes, _head_config(target_config, "LlamaForCausalLM"))


def make_tiny_eagle3(path: Path, target: Path, *, seed: int = 0, num_aux: int = 3,
                     draft_vocab_size: int | None = None) -> Path:
    """A random EAGLE-3 head for `target` in vLLM's format (the EAGLE-3 repository's: one decoder
    layer `midlayer.*` whose attention reads [embedding; hidden], `fc` over `num_aux` target layers'
    hidden states, `norm`, `lm_head`). With `draft_vocab_size` the head predicts the first that many
    token ids only, mapped back by `d2t` (offsets) and `t2d` (membership), as EAGLE-3's trimmed
    vocabulary."""
    path = Path(path)
    target_config = json.loads((Path(target) / "config.json").read_text())
    hidden = target_config["hidden_size"]
    if not _fresh(path, hidden, target_config["num_attention_heads"], seed):
        return path
    vocab, layers = target_config["vocab_size"], target_config["num_hidden_layers"]
    draft_vocab = draft_vocab_size or vocab
    shapes = {"midlayer.input_layernorm.weight": (hidden,), "midlayer.hidden_norm.weight": (hidden,),
              **_eagle_layer_shapes("midlayer", target_config, 2 * hidden),
              "norm.weight": (hidden,), "fc.weight": (hidden, num_aux * hidden), "lm_head.weight": (draft_vocab, hidden)}
    extra = {}
    if draft_vocab != vocab:
        extra["d2t"] = torch.zeros(draft_vocab, dtype=torch.long)  # draft id i is target id i
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[:draft_vocab] = True
        extra["t2d"] = t2d
    config = _head_config(
        target_config, "LlamaForCausalLMEagle3", draft_vocab_size=draft_vocab,
        # Which target layers feed `fc` (0 = the embeddings, l = after layer l); vLLM's default
        # (2, L/2, L-3) does not fit a 2-layer target.
        eagle_aux_hidden_state_layer_ids=[round(i * layers / (num_aux - 1)) for i in range(num_aux)])
    return _save_head(path, shapes, config, extra)


def train_tiny_eagle3(path: Path, target: Path, *, num_prompts: int = 40, epochs: int = 4,
                      extra_prompts: list[str] = (), **overrides) -> Path:
    """An EAGLE-3 head trained for `target` by `train-eagle` (HF generation, word-level prompts;
    seconds on a tiny model): drafts the target often agrees with, when the target's next-token
    distributions are peaked (`make_tiny_exit_llama`). A random tiny model's text has little that
    generalizes, so engine tests put their own prompts in `extra_prompts` (trained on, not held out)."""
    from vllm_sparsever.offline.eagle3.options import TrainEagleOptions
    from vllm_sparsever.offline.train_eagle import train_eagle

    path = Path(path)
    if (path / "config.json").exists():
        return path
    texts = [*extra_prompts, *prompts(num_prompts, length=16, seed=5)]
    rows = [{"id": f"row/{i}", "prompt": text} for i, text in enumerate(texts)]
    settings = dict(prompt_rows=rows, generator="hf", max_prompt_tokens=32, max_new_tokens=48, num_heldout_prompts=4,
                    samples_per_prompt=1,
                    epochs=epochs, lr=2e-3, draft_vocab=None, show_progress=False, output_dir=str(path))
    train_eagle(str(target), TrainEagleOptions(**{**settings, **overrides}))
    return path
