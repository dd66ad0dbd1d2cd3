"""A dense model's decoder linears quantized to int8 (W8A8) or int4 (W4A16), saved as a compressed-tensors
checkpoint.

For draft models: a draft pass at few tokens reads every weight once, so on a CPU it is bound by
memory bandwidth and half the bytes is close to half the time. vLLM loads the folder with its own
compressed-tensors support (`CompressedTensorsW8A8Int8`: on CPUs sgl-kernel's AMX/VNNI int8 GEMM or
oneDNN, on GPUs CUTLASS), so no kernel of ours runs it. Verification stays exact whatever the draft:
the target checks every drafted token.

Schemes (embeddings, norms, biases and the LM head stay in the base model's dtype in both: the LM head
is the most sensitive layer, and `draft_vocab` trims it):
- "w8a8-int8": weights symmetric int8 per output channel (round to nearest, scale = max|w| / 127),
  activations int8 per token, computed at run time (dynamic); "int-quantized" format.
- "w4a16-int4": weights symmetric int4 in groups of `INT4_GROUP_SIZE` input channels, each group's
  scale the one of a few clipped ranges with the least squared error (an MSE observer: round to
  nearest at the full range wastes most of 16 levels on a group's outliers); "pack-quantized" format
  (eight 4-bit values per int32). On CPUs with AMX, vLLM-CPU runs these layers as W4A8 (activations
  int8 per token, `VLLM_CPU_INT4_W4A8`, on by default): its W4A16 kernel dequantizes slower than
  bf16 reads the weights.
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
SCHEMES = ("w8a8-int8", "w4a16-int4")
INT4_GROUP_SIZE = 128
# Fractions of a group's max |w| tried as its int4 range (the one with the least squared error is kept).
INT4_CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)
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


def int4_config(group_size: int = INT4_GROUP_SIZE) -> dict[str, Any]:
    """compressed-tensors' quantization_config of the "w4a16-int4" scheme."""
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                            "group_size": group_size, "dynamic": False, "observer": "mse"},
                "input_activations": None,
            }
        },
    }


def quantize_int4_per_group(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE,
                            scale_dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` [N, K] -> (int8 values in [-8, 7] [N, K], scale [N, K / group_size] in `scale_dtype`)
    with `weight ~= q * scale` per group of `group_size` input channels (the scale is rounded to
    `scale_dtype` before rounding q, so vLLM dequantizes with the scale q was rounded against)."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"input size {k} is not a multiple of the int4 group size {group_size}")
    w = weight.float().view(n, k // group_size, group_size)
    top = w.abs().amax(dim=2, keepdim=True).clamp_min(1e-12)
    best_q, best_scale, best_err = None, None, None
    for ratio in INT4_CLIP_RATIOS:
        scale = (top * ratio / 7.5).to(scale_dtype).float().clamp_min(torch.finfo(scale_dtype).tiny)
        q = torch.round(w / scale).clamp_(-8, 7)
        err = ((q * scale - w) ** 2).sum(dim=2, keepdim=True)
        if best_err is None:
            best_q, best_scale, best_err = q, scale, err
            continue
        better = err < best_err
        best_q = torch.where(better, q, best_q)
        best_scale = torch.where(better, scale, best_scale)
        best_err = torch.minimum(err, best_err)
    return best_q.view(n, k).to(torch.int8), best_scale.squeeze(2).to(scale_dtype)


def _w8a8_tensors(name: str, tensor: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    q, scale = quantize_int8_per_channel(tensor)
    return {name: q, name[: -len("weight")] + "weight_scale": scale}, q.float() * scale


def _w4a16_tensors(name: str, tensor: torch.Tensor, group_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    q, scale = quantize_int4_per_group(tensor, group_size, scale_dtype=tensor.dtype)
    prefix = name[: -len("weight")]
    back = (q.float().view(q.shape[0], -1, group_size) * scale.float().unsqueeze(2)).view(q.shape)
    return {prefix + "weight_packed": pack_to_int32(q, 4), prefix + "weight_scale": scale,
            prefix + "weight_shape": torch.tensor(list(tensor.shape), dtype=torch.int64)}, back


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` [N, K] -> (int8 [N, K], fp32 scale [N, 1]) with `weight ~= q * scale` row by row (as
    int8_linear's rows: a draft's LM head rows are quantized at load the same way)."""
    from vllm_sparsever._custom_ops import quantize_int8_rows

    q, scale, _ = quantize_int8_rows(weight)
    return q, scale[:, None]


def build_w8a8_folder(base_dir: Path, out_dir: Path) -> dict[str, Any]:
    """Write `base_dir`'s model with int8 decoder linears to `out_dir`; returns manifest facts."""
    return build_quantized_folder(base_dir, out_dir, "w8a8-int8")


def build_quantized_folder(base_dir: Path, out_dir: Path, scheme: str,
                           group_size: int = INT4_GROUP_SIZE) -> dict[str, Any]:
    """Write `base_dir`'s model with its decoder linears quantized by `scheme` (one of SCHEMES; int4
    in groups of `group_size` input channels) to `out_dir`; returns manifest facts."""
    from safetensors.torch import load_file, save_file

    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; known: {', '.join(SCHEMES)}")
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
                if scheme == "w8a8-int8":
                    stored, back = _w8a8_tensors(name, tensor)
                else:
                    stored, back = _w4a16_tensors(name, tensor, group_size)
                err = ((back - tensor.float()).norm() / tensor.float().norm().clamp_min(1e-12)).item()
                max_rel_err = max(max_rel_err, err)
                out.update(stored)
                quantized += 1
            else:
                out[name] = tensor
                kept += 1
        save_file(out, out_dir / shard.name, metadata={"format": "pt"})
    if quantized == 0:
        raise ValueError(f"{base_dir}: no decoder linear weights matched {LINEAR_WEIGHT.pattern}")
    config = json.loads((base_dir / "config.json").read_text())
    config["quantization_config"] = COMPRESSED_TENSORS_CONFIG if scheme == "w8a8-int8" else int4_config(group_size)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for extra in base_dir.iterdir():
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in (
                "config.json", "sparsever_manifest.json") and not extra.name.startswith("."):
            shutil.copy2(extra, out_dir / extra.name)
    described = {
        "w8a8-int8": {"format": "compressed-tensors int-quantized",
                      "weights": "int8, symmetric, per output channel, round to nearest",
                      "activations": "int8, symmetric, per token, dynamic"},
        "w4a16-int4": {"format": "compressed-tensors pack-quantized",
                       "weights": f"int4, symmetric, groups of {group_size} input channels, least-squares clip",
                       "activations": "16-bit (vLLM-CPU with AMX: int8 per token, VLLM_CPU_INT4_W4A8)"},
    }[scheme]
    return {
        "architecture": config.get("architectures", ["?"])[0],
        "quantization": {
            "scheme": scheme,
            **described,
            "quantized_tensors": quantized,
            "kept_tensors": kept,
            "max_relative_weight_error": round(max_rel_err, 5),
        },
    }


__all__ = ["COMPRESSED_TENSORS_CONFIG", "INT4_GROUP_SIZE", "LINEAR_WEIGHT", "SCHEMES", "build_quantized_folder",
           "build_w8a8_folder", "int4_config", "quantize_int4_per_group", "quantize_int8_per_channel"]
