"""EAGLE-3 training recipes compared at equal optimizer steps on the same text: which layers the
head reads, how its input streams are scaled, which positions it trains on, its size, the learning
rate. The target's features are computed once (for the union of the recipes' layers, cached in
`<model>/eagle3_features/` as `train-eagle` caches them) and every recipe trains from them.

    python bench/eagle_recipes.py --recipes "base=aux:2/14/25,scale:none" "top=aux:2/14/28" --epochs 5

A recipe is `name=key:value,...` with keys aux (layer ids joined by /), scale (rms | none),
positions (generated | all), lr, epochs, draft_vocab, intermediate; unset keys take the flags'
values. The text is train-eagle's default (the target's continuations of the calibration
articles; the last 8 held out). Reports per recipe the held-out top-1 agreement per draft step and
the mean agreeing prefix (teacher-forced, as train-eagle's manifest), steps and training seconds.
With --save, each recipe's head is written in vLLM's EAGLE-3 format to <model>/eagle3_recipes/<name>.
Writes bench/results/eagle_recipes_<tag>_<stamp>.json/.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import RESULTS, hardware, versions  # noqa: E402

KEYS = ("aux", "scale", "positions", "lr", "epochs", "draft_vocab", "intermediate")


def parse_recipe(text: str, defaults: dict) -> tuple[str, dict]:
    name, _, spec = text.partition("=")
    recipe = dict(defaults)
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition(":")
        if key not in KEYS:
            raise SystemExit(f"--recipes: unknown key {key!r} in {text!r}; keys: {', '.join(KEYS)}")
        recipe[key] = (tuple(int(v) for v in value.split("/")) if key == "aux" else
                       float(value) if key == "lr" else int(value) if key in ("epochs", "draft_vocab", "intermediate")
                       else value)
    if recipe["scale"] not in ("rms", "none") or recipe["positions"] not in ("generated", "all"):
        raise SystemExit(f"--recipes: scale is rms or none, positions generated or all, in {text!r}")
    return name, recipe


def recipe_manifest(name: str, result: dict, feature_seconds: float) -> dict:
    """A saved recipe head's record, in the keys bench/drafters.py reads from train-eagle's manifest."""
    return {"tool": "bench/eagle_recipes.py", "recipe": name, "settings": result["recipe"],
            "steps": result["steps"], "train_tokens": result["train_positions"],
            "heldout": {"trained": result["heldout"]},
            "seconds": {"features": feature_seconds, "train": result["train_seconds"],
                        "total": feature_seconds + result["train_seconds"]}}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--recipes", nargs="+", required=True)
    p.add_argument("--aux", default="2/14/25", help="default layers, joined by /")
    p.add_argument("--scale", default="none", choices=("rms", "none"))
    p.add_argument("--positions", default="generated", choices=("generated", "all"))
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--save", action="store_true", help="write each head to <model>/eagle3_recipes/<name>")
    p.add_argument("--tag", default="qwen")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    defaults = {"aux": tuple(int(v) for v in args.aux.split("/")), "scale": args.scale, "positions": args.positions,
                "lr": args.lr, "epochs": args.epochs, "draft_vocab": args.draft_vocab,
                "intermediate": args.intermediate}
    recipes = dict(parse_recipe(r, defaults) for r in args.recipes)
    import torch

    from vllm_sparsever.cli import resolve_model
    from vllm_sparsever.offline.common import eos_token_ids, load_target, read_config
    from vllm_sparsever.offline.eagle3.features import cached_features, select_layers, stream_rms
    from vllm_sparsever.offline.eagle3.head import new_head, save_head
    from vllm_sparsever.offline.eagle3.options import TrainEagleOptions
    from vllm_sparsever.offline.eagle3.text import generated_text
    from vllm_sparsever.offline.eagle3.training import draft_vocabulary, evaluate, train_head
    from vllm_sparsever.offline.train_eagle import MANIFEST_NAME

    started = dt.datetime.now(dt.timezone.utc)
    target = resolve_model(args.target)
    config = read_config(target)
    options = TrainEagleOptions()
    text = generated_text(target, options)
    train_rows, heldout_rows, train_rows_seqs, hf_model = text.train_rows, text.heldout_rows, text.train, text.model
    if hf_model is None:
        hf_model, _ = load_target(target)
    union = tuple(sorted({a for r in recipes.values() for a in r["aux"]}))
    if any(not 0 <= a <= int(config["num_hidden_layers"]) for a in union):
        raise SystemExit(f"--recipes: aux layers in 0..{config['num_hidden_layers']}, got {list(union)}")
    t0 = time.monotonic()
    train_all = cached_features(target, hf_model, train_rows_seqs, union, "features (train)", True)
    heldout_all = cached_features(target, hf_model, text.heldout, union,
                                  "features (held-out)", True)
    feature_seconds = time.monotonic() - t0
    eos = eos_token_ids(hf_model.generation_config)
    lm_head_full = hf_model.get_output_embeddings().weight.detach().float()
    embed = hf_model.get_input_embeddings().float().requires_grad_(False)

    results = {}
    begun = time.monotonic()
    for i, (name, r) in enumerate(recipes.items()):
        every = r["positions"] == "all"
        train = select_layers(train_all, union, r["aux"], every)
        heldout = select_layers(heldout_all, union, r["aux"])
        texts = [s["prompt_ids"] + s["generated_ids"] if every else s["generated_ids"] for s in train_rows_seqs]
        draft_ids = draft_vocabulary(texts, int(config["vocab_size"]), r["draft_vocab"], eos)
        torch.manual_seed(0)
        head = new_head(config, len(r["aux"]), r["intermediate"], lm_head_full[draft_ids])
        if r["scale"] == "rms":
            head.aux_inv_scale.copy_(1.0 / stream_rms(train))
        t1 = time.monotonic()
        opts = TrainEagleOptions(epochs=r["epochs"], lr=r["lr"], show_progress=True)
        steps, planned, _, epoch_loss = train_head(head, embed, train, opts, float("inf"))
        train_seconds = time.monotonic() - t1
        scores = evaluate(head, embed, heldout, opts.ttt_steps, draft_ids)
        results[name] = {"recipe": {**r, "aux": list(r["aux"])}, "steps": steps, "train_seconds": round(train_seconds, 1),
                         "train_positions": sum(len(s.tokens) - s.first for s in train),
                         "loss_per_epoch": [round(v, 3) for v in epoch_loss], "heldout": scores}
        if args.save:
            out = Path(target) / "eagle3_recipes" / name
            save_head(out, head, draft_ids, config, r["aux"])
            (out / MANIFEST_NAME).write_text(json.dumps(recipe_manifest(name, results[name], feature_seconds), indent=1))
        done = time.monotonic() - begun
        print(f"[{i + 1}/{len(recipes)}] {name}: {json.dumps(scores)}; {train_seconds:.0f} s; "
              f"about {done / (i + 1) * (len(recipes) - i - 1) / 60:.0f} min left", flush=True)

    base = RESULTS / f"eagle_recipes_{args.tag}_{started.strftime('%Y%m%d-%H%M')}"
    record = {"command": " ".join([sys.executable, *sys.argv]), "started_utc": started.isoformat(), "target": target,
              "text": {"train": [r["id"] for r in train_rows], "heldout": [r["id"] for r in heldout_rows]},
              "feature_seconds": round(feature_seconds, 1), "union_layers": list(union),
              "hardware": hardware(), "versions": versions(), "results": results}
    RESULTS.mkdir(parents=True, exist_ok=True)
    base.with_suffix(".json").write_text(json.dumps(record, indent=1))
    md = [f"# EAGLE-3 training recipes ({args.tag})", "", f"`{record['command']}`", "",
          f"hardware: {record['hardware']}", "", f"features: {feature_seconds:.0f} s (0 when cached)", "",
          "| recipe | aux layers | scale | positions | lr | epochs | draft vocab | MLP | trained positions | steps | "
          "train s | held-out agreement per step | mean agreeing prefix |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, res in results.items():
        r, h = res["recipe"], res["heldout"]
        md.append(f"| {name} | {'/'.join(map(str, r['aux']))} | {r['scale']} | {r['positions']} | {r['lr']} | "
                  f"{r['epochs']} | {r['draft_vocab']} | {r['intermediate']} | {res['train_positions']} | "
                  f"{res['steps']} | {res['train_seconds']} | {' / '.join(map(str, h['agreement_per_step']))} | "
                  f"{h['mean_accepted_prefix']} |")
    base.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    print(f"results: {base}.json / .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
