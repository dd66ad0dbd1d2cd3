"""How often a quantized draft's greedy token equals the target's, teacher-forced over held-out text: the
draft model's linears fake-quantized as `models build` quantizes them (int8 per output channel, int4 in
groups of 128 with its clipped scales), their inputs quantized per token to int8 as the W8A8 and W4A8
kernels do (`int8_linear`, `int4_linear`), per variant. A cheap proxy for a draft's acceptance (no
engine, thousands of positions in a minute): which projections lose agreement in int4 tells which to
keep in int8.

Variants: bf16; w8a8 (every projection int8); w4a8 (every projection int4); w4-mlp (attention
projections int8, MLP int4); w4-no-down (down_proj int8, the rest int4); w4-ends (layers 0, 1 and the
last two int8, the rest int4); w8a8-head8 (w8a8, and the LM head int8 per row with its input int8 per
token, as `int8_head_rows_linear` runs it; the input embedding, tied to it, stays bf16). The LM head stays as
built (bf16) elsewhere.

    python bench/draft_agreement.py --variants bf16 w8a8 w4a8 w4-mlp --tokens 1536 --tag zen5
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

VARIANTS = ("bf16", "w8a8", "w4a8", "w4-mlp", "w4-no-down", "w4-ends", "w8a8-head8")


def int8_projection(variant: str, name: str, num_layers: int) -> bool:
    """Whether `variant` keeps projection `name` (a module name) in int8 rather than int4."""
    if variant in ("w8a8", "w8a8-head8"):
        return True
    if variant == "w4-mlp":
        return ".self_attn." in name
    if variant == "w4-no-down":
        return name.endswith("down_proj")
    if variant == "w4-ends":
        return any(f"layers.{i}." in name for i in (0, 1, num_layers - 2, num_layers - 1))
    return False


def fake_quantize(model, variant: str) -> int:
    """Fake-quantize `model`'s decoder linears in place as `variant` says; returns their weight bytes as
    stored (int8 1 byte, int4 half a byte a weight)."""
    import torch

    from vllm_sparsever.models.quantize import INT4_GROUP_SIZE, quantize_int4_per_group, quantize_int8_per_channel

    def per_token_int8(module, args):  # activations as the W8A8 / W4A8 kernels quantize them
        x = args[0].float()
        amax = x.abs().amax(-1, keepdim=True).clamp_min(1e-12)
        return (torch.round(x * 127 / amax).clamp(-127, 127) * amax / 127).to(args[0].dtype),

    def int8_rows(w):  # the weight after int8 per row, as `models build` (and the drafter's head) quantize it
        q, scale = quantize_int8_per_channel(w)
        return (q.float() * scale.float()).to(w.dtype)

    num_layers = model.config.num_hidden_layers
    stored = 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or "lm_head" in name:
            continue
        w = module.weight.data
        if variant == "bf16":
            stored += 2 * w.numel()
            continue
        if int8_projection(variant, name, num_layers):
            module.weight.data = int8_rows(w)
            stored += w.numel()
        else:
            q, scale = quantize_int4_per_group(w, INT4_GROUP_SIZE, torch.bfloat16)
            n = w.shape[0]
            module.weight.data = (q.float().view(n, -1, INT4_GROUP_SIZE) * scale.float().unsqueeze(2)).view_as(w).to(w.dtype)
            stored += w.numel() // 2
        module.register_forward_pre_hook(per_token_int8)
    if variant == "w8a8-head8":  # a copy: the input embedding keeps its bf16 rows
        head = model.lm_head
        head.weight = torch.nn.Parameter(int8_rows(head.weight.data), requires_grad=False)
        head.register_forward_pre_hook(per_token_int8)
    return stored


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b", help="the bf16 draft the variants quantize")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--category", default="wikipedia", help="held-out text (vllm-sparsever data; not the harness's prompts)")
    ap.add_argument("--tokens", type=int, default=1536)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tag", default=None)
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from record import RESULTS, hardware, save_results, versions
    from vllm_sparsever.data import load_prompts
    from vllm_sparsever.store.paths import models_root

    torch.set_num_threads(args.threads)
    target_path, draft_path = (str(models_root() / name) for name in (args.target, args.draft))
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    text = "\n\n".join(row["prompt"] for row in load_prompts(args.category, n=64))
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : args.tokens]
    started = dt.datetime.now(dt.timezone.utc)
    with torch.inference_mode():
        target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.bfloat16)
        target_top1 = target(ids).logits.argmax(-1)[0, :-1]
        del target
        rows = []
        for variant in args.variants:
            start = time.perf_counter()
            draft = AutoModelForCausalLM.from_pretrained(draft_path, dtype=torch.bfloat16)
            stored = fake_quantize(draft, variant)
            agreement = (draft(ids).logits.argmax(-1)[0, :-1] == target_top1).float().mean().item()
            rows.append({"variant": variant, "agreement": agreement, "linear_bytes": stored})
            print(f"{variant}: agreement {agreement:.4f}, linears {stored / 1e6:.0f} MB ({time.perf_counter() - start:.0f} s)",
                  flush=True)
            del draft
    base = RESULTS / f"draft_agreement_{args.tag or args.draft}_{started.strftime('%Y%m%d-%H%M')}"
    record = {"command": " ".join([sys.executable, *sys.argv]), "args": vars(args), "started": started.isoformat(),
              "hardware": hardware(), "versions": versions(), "positions": int(ids.shape[1]) - 1, "rows": rows}
    lines = [f"# Teacher-forced top-1 agreement with {args.target}: {args.draft} fake-quantized", "",
             f"`{record['command']}`", "", f"hardware: {record['hardware']}", "",
             f"{record['positions']} positions of `{args.category}` text; activations int8 per token wherever a "
             "projection is quantized (as the W8A8 / W4A8 kernels run them); the LM head as built but in w8a8-head8.", "",
             "| variant | agreement | linears MB |", "|---|---|---|"]
    lines += [f"| {r['variant']} | {r['agreement']:.4f} | {r['linear_bytes'] / 1e6:.0f} |" for r in rows]
    save_results(base, record, lines)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
