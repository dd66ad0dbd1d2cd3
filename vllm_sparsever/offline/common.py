"""What the offline training jobs (`train-exits`, `train-eagle`) share about their target: the error
they raise for a bad input, the model folder, its config, the frozen Hugging Face target and its
end-of-text ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


class TrainingError(ValueError):
    """A training job cannot run as asked (names the flag and the allowed values)."""


def resolve_model_dir(name_or_path: str) -> str:
    """A local folder as it is; else a built model name (unknown or unbuilt: a clear error)."""
    from vllm_sparsever.models import ModelArgumentError, resolve_model_arg

    try:
        return resolve_model_arg(name_or_path, "MODEL")
    except ModelArgumentError as exc:
        raise TrainingError(str(exc)) from None


def read_config(model_dir: str) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise TrainingError(f"MODEL: {model_dir} has no config.json (not a Hugging Face model folder)")
    config = json.loads(path.read_text())
    # Multimodal wrappers keep the language model's fields in text_config.
    return {**config.get("text_config", {}), **config}


def load_target(model_dir: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval().requires_grad_(False)
    return model, tokenizer



def eos_token_ids(generation_config) -> tuple[int, ...]:
    """The EOS token ids of a HF generation config (one id or a list), in order, without None."""
    eos = generation_config.eos_token_id
    return tuple(dict.fromkeys(t for t in (eos if isinstance(eos, list) else [eos]) if t is not None))

