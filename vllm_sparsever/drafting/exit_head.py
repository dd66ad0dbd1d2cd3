"""Early-exit heads: turn the target's residual stream after layer L into next-token logits.

One head per exit layer L. Untrained (adapter `up` = 0) it is exactly "final norm + LM head at
layer L"; training (`vllm-sparsever train-exits`) fits the adapter and the output norm by
self-distillation against the target's own final layer, with the target frozen.

    x   = residual stream after decoder layers 0..L-1   (HF: `output_hidden_states[L]`;
                                                         vLLM: hidden_states + residual)
    y   = x + up(silu(down(rms_norm(x, norm_in))))      (a residual bottleneck adapter)
    out = rms_norm(y, norm_out)                         -> the caller applies the LM head

The LM head is the target's (shared, never copied): in vLLM through its logits processor so
tensor-parallel ranks all-gather the vocabulary shards; in training with the frozen weight.

On disk (next to the model, `<model>/exit_heads/`):
    manifest.json             format, the model it belongs to, one entry per head (see below)
    exit_<L>.safetensors      norm_in.weight [d], down.weight [r, d], up.weight [d, r],
                              norm_out.weight [d]
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

HEADS_DIRNAME = "exit_heads"
MANIFEST_NAME = "manifest.json"
FORMAT = 1
# Architectures whose decoder layers are pre-norm RMSNorm blocks with a plain (1 * w) final
# RMSNorm and an untied-or-tied LM head without soft-capping: the head math above holds for them
# (the MoE ones too: their blocks differ in the MLP only).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                           "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")


class ExitHeadError(ValueError):
    """Missing, malformed or mismatched exit heads (names the file and what was expected)."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Llama/Qwen compute it: in fp32, then back to the input dtype."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32.to(dtype) if dtype != torch.float32 else x32) * weight


class ExitHead(nn.Module):
    def __init__(self, hidden_size: int, adapter_size: int, eps: float):
        super().__init__()
        self.hidden_size = hidden_size
        self.adapter_size = adapter_size
        self.eps = eps
        self.norm_in = nn.Parameter(torch.ones(hidden_size))
        self.down = nn.Linear(hidden_size, adapter_size, bias=False)
        self.up = nn.Linear(adapter_size, hidden_size, bias=False)
        self.norm_out = nn.Parameter(torch.ones(hidden_size))
        nn.init.zeros_(self.up.weight)  # untrained head == final norm + LM head at layer L

    @classmethod
    def untrained(cls, final_norm_weight: torch.Tensor, adapter_size: int, eps: float) -> "ExitHead":
        head = cls(final_norm_weight.numel(), adapter_size, eps)
        with torch.no_grad():
            head.norm_out.copy_(final_norm_weight.float())
        return head

    def forward(self, residual_stream: torch.Tensor) -> torch.Tensor:
        x = residual_stream
        y = x + self.up(F.silu(self.down(rms_norm(x, self.norm_in, self.eps))))
        return rms_norm(y, self.norm_out, self.eps)

    # ---- (de)serialisation -------------------------------------------------------------------

    def state_for_file(self) -> dict[str, torch.Tensor]:
        return {
            "norm_in.weight": self.norm_in.detach().float().contiguous(),
            "down.weight": self.down.weight.detach().float().contiguous(),
            "up.weight": self.up.weight.detach().float().contiguous(),
            "norm_out.weight": self.norm_out.detach().float().contiguous(),
        }

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        save_file(self.state_for_file(), str(path))

    @classmethod
    def load(cls, path: str | Path, eps: float, dtype: torch.dtype = torch.float32) -> "ExitHead":
        from safetensors.torch import load_file

        try:
            tensors = load_file(str(path))
        except FileNotFoundError as exc:
            raise ExitHeadError(f"exit head file {path} does not exist") from exc
        expected = ("norm_in.weight", "down.weight", "up.weight", "norm_out.weight")
        missing = [k for k in expected if k not in tensors]
        if missing:
            raise ExitHeadError(f"exit head {path}: missing tensors {missing} (expected {list(expected)})")
        adapter_size, hidden_size = tensors["down.weight"].shape
        head = cls(hidden_size, adapter_size, eps)
        with torch.no_grad():
            head.norm_in.copy_(tensors["norm_in.weight"])
            head.down.weight.copy_(tensors["down.weight"])
            head.up.weight.copy_(tensors["up.weight"])
            head.norm_out.copy_(tensors["norm_out.weight"])
        return head.to(dtype).eval().requires_grad_(False)


@dataclass
class ExitHeadEntry:
    exit_layer: int  # the head reads the residual stream after this many decoder layers
    file: str
    adapter_size: int
    # Top-1 agreement with the target's final layer on held-out text (None = not measured).
    agreement_untrained: float | None = None
    agreement_trained: float | None = None
    heldout_tokens: int = 0


@dataclass
class ExitHeadManifest:
    model_architecture: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    heads: list[ExitHeadEntry] = field(default_factory=list)
    training: dict[str, Any] = field(default_factory=dict)
    format: int = FORMAT

    def head_for(self, exit_layer: int) -> ExitHeadEntry:
        for entry in self.heads:
            if entry.exit_layer == exit_layer:
                return entry
        raise ExitHeadError(
            f"exit_layer: no trained head for layer {exit_layer} "
            f"(allowed: {sorted(e.exit_layer for e in self.heads)}); train one with "
            f"`vllm-sparsever train-exits MODEL --exit-layers {exit_layer}`"
        )

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / MANIFEST_NAME
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> "ExitHeadManifest":
        path = Path(directory) / MANIFEST_NAME
        if not path.is_file():
            raise ExitHeadError(
                f"no exit heads at {directory} ({MANIFEST_NAME} missing); build them with "
                f"`vllm-sparsever train-exits MODEL`"
            )
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT:
            raise ExitHeadError(f"{path}: format {data.get('format')!r}, this version reads {FORMAT}")
        heads = [ExitHeadEntry(**h) for h in data.pop("heads", [])]
        return cls(heads=heads, **data)

    def check_model(self, architecture: str, num_hidden_layers: int, hidden_size: int, vocab_size: int) -> None:
        """Raise if these heads were trained for a model of another shape."""
        ours = (self.model_architecture, self.num_hidden_layers, self.hidden_size, self.vocab_size)
        theirs = (architecture, num_hidden_layers, hidden_size, vocab_size)
        if ours != theirs:
            raise ExitHeadError(
                f"exit heads were trained for (architecture, layers, hidden, vocab) = {ours}, "
                f"the target is {theirs}; retrain with `vllm-sparsever train-exits`"
            )


def heads_dir(model_dir: str | Path) -> Path:
    return Path(model_dir) / HEADS_DIRNAME
