"""What an EAGLE-3 head trains on: per sequence, from one fp32 forward pass of the target, the
residual streams vLLM hands the head (`aux_layers`: 0 = the embeddings, l = after decoder layer l),
the final-normed hidden state (the teacher's logits come from it) and the target's argmax. Cached in
`<model>/eagle3_features/`, one file per text holding every layer computed so far."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_sparsever.offline.common import TrainingError

FEATURES_DIRNAME = "eagle3_features"


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
        raise TrainingError("no generated tokens to train on (every generation was empty)")
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
