"""Quality of FFN sparsity variants (issue 14), offline, teacher-forced, against the bytes they read.

    python bench/ffn_quality.py --model qwen2.5-coder-1.5b [--keeps 0.3 0.5 0.7] [--group 4]
    python bench/ffn_quality.py --variants neuron teal --input-keeps 0.3 0.5

On held-out text, every MLP of the HF model is sparsified at once with one selection per window of
`--group` consecutive tokens (a verify step's tokens, one selection per request as the op makes it):
top-1 agreement of the next-token prediction with the dense model and KL(dense || sparse), next to
the share of the dense MLP's weight bytes the variant reads. Variants:
- `neuron`: top-k neurons by summed |silu(gate)| (`topk_swiglu_ffn`): the gate read densely,
  bytes (1 + 2k)/3;
- `teal` / `teal_exact`: a cheaper predictor for the gate (TEAL-style input sparsity): the window's
  top `--input-keeps` share of hidden channels by summed |x| (one set per window) computes an
  approximate gate from those channels' weights only (a transposed gate copy makes a channel one
  contiguous row); the top-k neurons by it are kept, and their SwiGLU product uses the approximate
  gate (`teal`, bytes (i + 2k)/3) or the exact gate of the kept neurons (`teal_exact`, (i + 3k)/3);
- `block` (tried for a packed layout, dropped): whole 16-neuron blocks,
- block top-k in the checkpoint's neuron order,
- block top-k after a neuron permutation made from calibration text (disjoint from the held-out
  text): `mean` sorts neurons by mean |silu(gate)|, `cluster` groups co-activated neurons by
  balanced k-means on their activations. Both permute within 8 equal segments of the neurons, so
  the blocks stay inside every tensor-parallel shard for TP in {1, 2, 4, 8}; the MLP's output is
  invariant to the permutation, only the blocks change.
Writes bench/results/ffn_quality_<model>_<date>.{json,md} (the block rows of 2026-11-25 were
written as ffn_blocks_quality_*, by this script's first version).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vllm_sparsever.offline.calibration.calibrate import resolve_model_dir  # noqa: E402
from vllm_sparsever.models.moefication import (balanced_kmeans, calibration_texts,  # noqa: E402
                                               heldout_texts, pack_sequences)

BLOCK = 16
SEGMENTS = 8  # permutations stay inside I/8 segments: valid for TP 1, 2, 4, 8


def mlps(model) -> list:
    return [layer.mlp for layer in model.model.layers]


def capture_activations(model, ids: torch.Tensor, max_tokens: int) -> list[torch.Tensor]:
    """|silu(gate)| of every MLP on the calibration tokens, [N, I] per layer (N <= max_tokens)."""
    acts: list[list[torch.Tensor]] = [[] for _ in mlps(model)]
    hooks = []
    for i, mlp in enumerate(mlps(model)):
        def hook(module, inputs, i=i):
            x = inputs[0].reshape(-1, inputs[0].shape[-1])
            acts[i].append(F.silu(module.gate_proj(x)).abs().float())
        hooks.append(mlp.register_forward_pre_hook(hook))
    with torch.no_grad():
        for seq in ids:
            model(seq[None])
    for h in hooks:
        h.remove()
    return [torch.cat(a)[:max_tokens] for a in acts]


def neuron_order(act: torch.Tensor, how: str, seed: int) -> torch.Tensor:
    """A permutation of the I neurons (new position -> old neuron), within SEGMENTS equal segments."""
    inter = act.shape[1]
    seg = inter // SEGMENTS
    if how == "identity" or seg % BLOCK:
        return torch.arange(inter)
    parts = []
    for s in range(SEGMENTS):
        cols = torch.arange(s * seg, (s + 1) * seg)
        a = act[:, cols]
        if how == "mean":
            parts.append(cols[torch.argsort(a.mean(0), descending=True, stable=True)])
        elif how == "cluster":
            labels = balanced_kmeans(a.T.contiguous(), seg // BLOCK, iters=6, seed=seed + s)
            parts.append(cols[torch.argsort(labels, stable=True)])
        else:
            raise ValueError(how)
    return torch.cat(parts)


def window_sum(v: torch.Tensor, group: int) -> torch.Tensor:
    """[b, t, n] -> [b, W, n]: sums over windows of `group` consecutive tokens (the last one padded)."""
    b, t, n = v.shape
    return F.pad(v, (0, 0, 0, (-t) % group)).reshape(b, -1, group, n).sum(2)


def per_token(mask: torch.Tensor, group: int, t: int) -> torch.Tensor:
    return mask.repeat_interleave(group, dim=1)[:, :t]


def topk_mask(scores: torch.Tensor, share: float) -> torch.Tensor:
    k = max(1, round(share * scores.shape[-1]))
    return torch.zeros_like(scores).scatter_(-1, scores.topk(k, dim=-1).indices, 1.0)


class SparseMLP(torch.nn.Module):
    """One selection per window of `group` consecutive tokens (keep mask applied to the SwiGLU product)."""

    def __init__(self, mlp, mode: str, keep: float, group: int, order: torch.Tensor | None = None,
                 input_keep: float = 1.0):
        super().__init__()
        self.mlp, self.mode, self.keep, self.group, self.order = mlp, mode, keep, group, order
        self.input_keep = input_keep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        gate = self.mlp.gate_proj(x)
        if self.mode in ("teal", "teal_exact"):
            # Approximate gate from the window's largest input channels only.
            x_mask = per_token(topk_mask(window_sum(x.abs(), self.group), self.input_keep), self.group, t)
            approx = F.silu(self.mlp.gate_proj(x * x_mask))
            scores = window_sum(approx.abs(), self.group)
            act = approx if self.mode == "teal" else F.silu(gate)
        else:
            act = F.silu(gate)
            scores = window_sum(act.abs(), self.group)
        hid = act * self.mlp.up_proj(x)
        inter = act.shape[-1]
        if self.mode != "block":
            mask = topk_mask(scores, self.keep)
        else:
            nb = inter // BLOCK
            perm = scores[..., self.order].reshape(*scores.shape[:2], nb, BLOCK).sum(-1)  # [b, W, nb]
            mask_perm = topk_mask(perm, self.keep).repeat_interleave(BLOCK, dim=-1)
            mask = torch.empty_like(mask_perm)
            mask[..., self.order] = mask_perm
        return self.mlp.down_proj(hid * per_token(mask, self.group, t))


def bytes_share(mode: str, keep: float, input_keep: float) -> float:
    """Share of the dense MLP's weight bytes the variant reads per selection."""
    return {"neuron": (1 + 2 * keep) / 3, "block": (1 + 2 * keep) / 3, "teal": (input_keep + 2 * keep) / 3,
            "teal_exact": (input_keep + 3 * keep) / 3}[mode]


def evaluate(model, ids: torch.Tensor, dense_logits: list[torch.Tensor]) -> dict:
    agree = kl = n = 0.0
    with torch.no_grad():
        for seq, ref in zip(ids, dense_logits):
            logits = model(seq[None]).logits[0].float()
            agree += float((logits.argmax(-1) == ref.argmax(-1)).sum())
            kl += float(F.kl_div(logits.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                 reduction="sum"))
            n += seq.numel()
    return {"top1_agreement": agree / n, "kl_per_token": kl / n, "tokens": int(n)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--keeps", type=float, nargs="+", default=[0.3, 0.5, 0.7])
    ap.add_argument("--group", type=int, default=4, help="tokens sharing one selection (a verify step)")
    ap.add_argument("--variants", nargs="+", default=["neuron", "block"],
                    choices=["neuron", "block", "teal", "teal_exact"])
    ap.add_argument("--orders", nargs="+", default=["identity", "mean", "cluster"], help="block variant only")
    ap.add_argument("--input-keeps", type=float, nargs="+", default=[0.3, 0.5], help="teal variants only")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--calib-seqs", type=int, default=8)
    ap.add_argument("--eval-seqs", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_model_dir(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    calib = pack_sequences(tok, calibration_texts(), args.seq_len, args.calib_seqs, seed=0)
    held = pack_sequences(tok, heldout_texts(), args.seq_len, args.eval_seqs, seed=1)
    t0 = time.time()
    print("calibration activations ...", flush=True)
    orders = {}
    acts = capture_activations(model, calib, max_tokens=2048) if "block" in args.variants else []
    for how in (args.orders if "block" in args.variants else []):
        print(f"neuron order: {how} ...", flush=True)
        orders[how] = [neuron_order(a, how, seed=i) for i, a in enumerate(tqdm(acts, desc=how))]
    with torch.no_grad():
        dense = [model(seq[None]).logits[0].float() for seq in held]
    originals = mlps(model)
    variants = []
    for mode in args.variants:
        for keep in args.keeps:
            if mode == "neuron":
                variants.append((mode, None, keep, 1.0))
            elif mode == "block":
                variants += [(mode, how, keep, 1.0) for how in args.orders]
            else:
                variants += [(mode, None, keep, ik) for ik in args.input_keeps]
    rows = []
    for mode, how, keep, input_keep in tqdm(variants, desc="variants"):
        for i, (layer, mlp) in enumerate(zip(model.model.layers, originals)):
            layer.mlp = SparseMLP(mlp, mode, keep, args.group, orders[how][i] if how else None, input_keep)
        rows.append({"mode": mode, "order": how, "keep": keep, "input_keep": input_keep,
                     "bytes_share": bytes_share(mode, keep, input_keep), **evaluate(model, held, dense)})
        print(rows[-1], flush=True)
    for layer, mlp in zip(model.model.layers, originals):
        layer.mlp = mlp
    result = {"date": dt.datetime.now().isoformat(timespec="seconds"), "command": " ".join(sys.argv),
              "model": args.model, "group": args.group, "seq_len": args.seq_len, "calib_seqs": args.calib_seqs,
              "eval_seqs": args.eval_seqs, "machine": platform.processor() or platform.machine(),
              "loadavg": os.getloadavg(), "seconds": time.time() - t0, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"ffn_quality_{args.model}_{dt.date.today().isoformat()}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    lines = [f"# FFN sparsity variants: quality vs bytes ({args.model}, fp32, teacher-forced)", "",
             f"`{result['command']}`; one selection per {args.group} consecutive tokens, every MLP sparse; "
             f"{rows[0]['tokens']} held-out tokens (Lee test + Wikipedia test half); block neuron orders from "
             f"{args.calib_seqs}x{args.seq_len} calibration tokens (train texts).", "",
             "| variant | neuron order | keep | input keep | bytes (share of dense MLP) | top-1 agreement with dense | KL(dense || sparse) per token |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ik = f"{r['input_keep']}" if r["mode"].startswith("teal") else "-"
        lines.append(f"| {r['mode']} | {r['order'] or '-'} | {r['keep']} | {ik} | {r['bytes_share']:.3f} | "
                     f"{r['top1_agreement']:.4f} | {r['kl_per_token']:.4f} |")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
