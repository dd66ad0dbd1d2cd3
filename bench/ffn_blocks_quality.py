"""What selecting FFN neurons in blocks of 16 costs in quality (issue 14), offline, teacher-forced.

    python bench/ffn_blocks_quality.py --model qwen2.5-coder-1.5b [--keeps 0.3 0.5 0.7] [--group 4]

The packed kernel (`topk_block_swiglu_ffn`) keeps whole 16-neuron blocks, one set per request's verify
tokens. This measures, on held-out text, every MLP of the HF model sparsified at once with one
selection per window of `--group` consecutive tokens (a verify step's tokens): top-1 agreement of
the next-token prediction with the dense model and KL(dense || sparse), for
- neuron top-k (the row kernel, `topk_swiglu_ffn`),
- block top-k in the checkpoint's neuron order,
- block top-k after a neuron permutation made from calibration text (disjoint from the held-out
  text): `mean` sorts neurons by mean |silu(gate)|, `cluster` groups co-activated neurons by
  balanced k-means on their activations. Both permute within 8 equal segments of the neurons, so
  the blocks stay inside every tensor-parallel shard for TP in {1, 2, 4, 8}; the MLP's output is
  invariant to the permutation, only the blocks change.
Writes bench/results/ffn_blocks_quality_<model>_<date>.{json,md}.
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

from vllm_sparsever.calibration.calibrate import resolve_model_dir  # noqa: E402
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


class SparseMLP(torch.nn.Module):
    """One selection per window of `group` consecutive tokens (keep mask applied to the SwiGLU product)."""

    def __init__(self, mlp, mode: str, keep: float, group: int, order: torch.Tensor | None):
        super().__init__()
        self.mlp, self.mode, self.keep, self.group, self.order = mlp, mode, keep, group, order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        act = F.silu(self.mlp.gate_proj(x))
        hid = act * self.mlp.up_proj(x)
        inter = act.shape[-1]
        pad = (-t) % self.group
        scores = F.pad(act.abs(), (0, 0, 0, pad)).reshape(b, -1, self.group, inter).sum(2)  # [b, W, I]
        if self.mode == "neuron":
            k = max(1, round(self.keep * inter))
            mask = torch.zeros_like(scores).scatter_(-1, scores.topk(k, dim=-1).indices, 1.0)
        else:
            nb = inter // BLOCK
            kb = max(1, round(self.keep * nb))
            perm = scores[..., self.order].reshape(*scores.shape[:2], nb, BLOCK).sum(-1)  # [b, W, nb]
            block_mask = torch.zeros_like(perm).scatter_(-1, perm.topk(kb, dim=-1).indices, 1.0)
            mask_perm = block_mask.repeat_interleave(BLOCK, dim=-1)
            mask = torch.empty_like(mask_perm)
            mask[..., self.order] = mask_perm
        mask = mask.repeat_interleave(self.group, dim=1)[:, :t]
        return self.mlp.down_proj(hid * mask)


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
    ap.add_argument("--orders", nargs="+", default=["identity", "mean", "cluster"])
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
    acts = capture_activations(model, calib, max_tokens=2048)
    orders = {}
    for how in args.orders:
        print(f"neuron order: {how} ...", flush=True)
        orders[how] = [neuron_order(a, how, seed=i) for i, a in enumerate(tqdm(acts, desc=how))]
    with torch.no_grad():
        dense = [model(seq[None]).logits[0].float() for seq in held]
    originals = mlps(model)
    variants = [("neuron", None, k) for k in args.keeps] + [
        ("block", how, k) for how in args.orders for k in args.keeps]
    rows = []
    for mode, how, keep in tqdm(variants, desc="variants"):
        for i, (layer, mlp) in enumerate(zip(model.model.layers, originals)):
            layer.mlp = SparseMLP(mlp, mode, keep, args.group, orders[how][i] if how else None)
        rows.append({"mode": mode, "order": how, "keep": keep, **evaluate(model, held, dense)})
        print(rows[-1], flush=True)
    for layer, mlp in zip(model.model.layers, originals):
        layer.mlp = mlp
    result = {"date": dt.datetime.now().isoformat(timespec="seconds"), "command": " ".join(sys.argv),
              "model": args.model, "group": args.group, "seq_len": args.seq_len, "calib_seqs": args.calib_seqs,
              "eval_seqs": args.eval_seqs, "machine": platform.processor() or platform.machine(),
              "loadavg": os.getloadavg(), "seconds": time.time() - t0, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"ffn_blocks_quality_{args.model}_{dt.date.today().isoformat()}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Block-granular FFN selection: quality ({args.model}, fp32, teacher-forced)", "",
             f"`{result['command']}`; one selection per {args.group} consecutive tokens, every MLP sparse; "
             f"{rows[0]['tokens']} held-out tokens (Lee test + Wikipedia test half); neuron orders from "
             f"{args.calib_seqs}x{args.seq_len} calibration tokens (train texts).", "",
             "| selection | neuron order | keep | top-1 agreement with dense | KL(dense || sparse) per token |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['order'] or '-'} | {r['keep']} | {r['top1_agreement']:.4f} | "
                     f"{r['kl_per_token']:.4f} |")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
