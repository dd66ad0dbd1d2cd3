"""A dense model's decoder linears quantized to int8 (W8A8), saved as a compressed-tensors checkpoint.

For draft models: a draft pass at few tokens reads every weight once, so on a CPU it is bound by
memory bandwidth and half the bytes is close to half the time. vLLM loads the folder with its own
compressed-tensors support (`CompressedTensorsW8A8Int8`: on CPUs sgl-kernel's AMX/VNNI int8 GEMM or
oneDNN, on GPUs CUTLASS), so no kernel of ours runs it. Verification stays exact whatever the draft:
the target checks every drafted token.

Scheme: weights symmetric int8 per output channel (round to nearest, scale = max|w| / 127),
activations int8 per token, computed at run time (dynamic). Embeddings, norms, biases and the LM head
stay in the base model's dtype (the LM head is the most sensitive layer, and `draft_vocab` trims it).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch

# Decoder linears of Llama / Qwen2-style checkpoints: the only tensors quantized.
LINEAR_WEIGHT = re.compile(r"^model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)\.weight$")
SCHEMES = ("w8a8-int8",)
COMPRESSED_TENSORS_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "quantization_status": "compressed",
    "ignore": ["lm_head"],
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                        "dynamic": False, "observer": "minmax"},
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                  "dynamic": True, "observer": None},
        }
    },
}


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` [N, K] -> (int8 [N, K], fp32 scale [N, 1]) with `weight ~= q * scale` row by row."""
    w = weight.float()
    scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0
    q = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)
    return q, scale


def build_w8a8_folder(base_dir: Path, out_dir: Path) -> dict[str, Any]:
    """Write `base_dir`'s model with int8 decoder linears to `out_dir`; returns manifest facts."""
    from safetensors.torch import load_file, save_file

    base_dir, out_dir = Path(base_dir), Path(out_dir)
    shards = sorted(base_dir.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{base_dir}: no .safetensors weights to quantize")
    quantized, kept, max_rel_err = 0, 0, 0.0
    for shard in shards:
        tensors = load_file(shard)
        out: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            if LINEAR_WEIGHT.match(name):
                q, scale = quantize_int8_per_channel(tensor)
                err = ((q.float() * scale - tensor.float()).norm() / tensor.float().norm().clamp_min(1e-12)).item()
                max_rel_err = max(max_rel_err, err)
                out[name] = q
                out[name[: -len("weight")] + "weight_scale"] = scale
                quantized += 1
            else:
                out[name] = tensor
                kept += 1
        save_file(out, out_dir / shard.name, metadata={"format": "pt"})
    if quantized == 0:
        raise ValueError(f"{base_dir}: no decoder linear weights matched {LINEAR_WEIGHT.pattern}")
    config = json.loads((base_dir / "config.json").read_text())
    config["quantization_config"] = COMPRESSED_TENSORS_CONFIG
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for extra in base_dir.iterdir():
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in (
                "config.json", "sparsever_manifest.json") and not extra.name.startswith("."):
            shutil.copy2(extra, out_dir / extra.name)
    return {
        "architecture": config.get("architectures", ["?"])[0],
        "quantization": {
            "scheme": "w8a8-int8",
            "format": "compressed-tensors int-quantized",
            "weights": "int8, symmetric, per output channel, round to nearest",
            "activations": "int8, symmetric, per token, dynamic",
            "quantized_tensors": quantized,
            "kept_tensors": kept,
            "max_relative_weight_error": round(max_rel_err, 5),
        },
    }


__all__ = ["COMPRESSED_TENSORS_CONFIG", "LINEAR_WEIGHT", "SCHEMES", "build_w8a8_folder", "quantize_int8_per_channel"]
