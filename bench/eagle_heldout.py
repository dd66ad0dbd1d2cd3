"""Held-out agreement of EAGLE-3 heads trained here (`vllm-sparsever train-eagle`), side by side on
the same held-out text: the target's own continuations of the held-out calibration articles (what
train-eagle reports) and held-out Python source (standard-library files no `--code-tokens` head
trained on). Features are computed once and shared by every head.

    python bench/eagle_heldout.py --heads <model>/eagle3_head_a <model>/eagle3_head_b --tag zen3

Per head and text: top-1 agreement with the target per draft step (teacher-forced, the head's token
mapped to the target's vocabulary against the target's argmax) and the mean agreeing prefix of a
3-step chain. Writes bench/results/eagle_heldout_<tag>_<stamp>.json/.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import RESULTS, hardware, versions  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--heads", nargs="+", required=True, help="head folders train-eagle wrote")
    p.add_argument("--code-heldout-tokens", type=int, default=4096)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tag", default="qwen")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from vllm_sparsever.cli import resolve_model
    from vllm_sparsever.offline.common import read_config
    from vllm_sparsever.offline.eagle3.features import extract_features
    from vllm_sparsever.offline.eagle3.head import load_head
    from vllm_sparsever.offline.eagle3.options import TrainEagleOptions
    from vllm_sparsever.offline.eagle3.text import generated_text, python_code
    from vllm_sparsever.offline.eagle3.training import evaluate
    from vllm_sparsever.offline.train_eagle import MANIFEST_NAME

    started = dt.datetime.now(dt.timezone.utc)
    target = resolve_model(args.target)
    config = read_config(target)
    options = TrainEagleOptions(code_tokens=1, code_heldout_tokens=args.code_heldout_tokens)
    # The rows train-eagle generates with its defaults, so that their cached text is found.
    text = generated_text(target, options)
    heldout_rows, seqs, hf_model = text.heldout_rows, text.heldout, text.model
    _, code_rows = python_code(target, options)
    if hf_model is None:
        from vllm_sparsever.offline.common import load_target

        hf_model, _ = load_target(target)
    heads = {path: load_head(path, config) for path in args.heads}
    features: dict[tuple[int, ...], dict[str, list]] = {}
    for _, aux, _ in heads.values():
        if aux not in features:
            features[aux] = {
                "generated": extract_features(hf_model, seqs, aux, "features (held-out articles)", True),
                "python": extract_features(hf_model, code_rows, aux, "features (held-out Python)", True,
                                           all_positions=True),
            }
    embed = hf_model.get_input_embeddings().float().requires_grad_(False)
    results = {}
    for path, (head, aux, draft_ids) in heads.items():
        manifest_path = Path(path) / MANIFEST_NAME
        manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
        with torch.no_grad():
            scores = {name: evaluate(head, embed, rows, args.steps, draft_ids) for name, rows in features[aux].items()}
        results[path] = {"scores": scores, "train_tokens": manifest.get("train_tokens"),
                         "train_minutes": round((manifest.get("seconds") or {}).get("total", 0.0) / 60, 1),
                         "steps": manifest.get("steps"), "settings": manifest.get("settings"),
                         "code_train_files": len(((manifest.get("data") or {}).get("code") or {}).get("train_files", []))}
        print(path, json.dumps(scores))
    base = RESULTS / f"eagle_heldout_{args.tag}_{started.strftime('%Y%m%d-%H%M')}"
    record = {"command": " ".join([sys.executable, *sys.argv]), "started_utc": started.isoformat(), "target": target,
              "heldout": {"generated": [r["id"] for r in heldout_rows], "python": [r["id"] for r in code_rows]},
              "hardware": hardware(), "versions": versions(), "results": results}
    RESULTS.mkdir(parents=True, exist_ok=True)
    base.with_suffix(".json").write_text(json.dumps(record, indent=1))
    md = [f"# Held-out agreement of EAGLE-3 heads ({args.tag})", "", f"`{record['command']}`", "",
          f"hardware: {record['hardware']}", "",
          "| head | train tokens | train min | steps | articles: agreement per step | prefix | "
          "Python: agreement per step | prefix |", "|---|---|---|---|---|---|---|---|"]
    for path, r in results.items():
        g, py = r["scores"]["generated"], r["scores"]["python"]
        md.append(f"| {Path(path).name} | {r['train_tokens']} | {r['train_minutes']} | {r['steps']} | "
                  f"{' / '.join(map(str, g['agreement_per_step']))} | {g['mean_accepted_prefix']} | "
                  f"{' / '.join(map(str, py['agreement_per_step']))} | {py['mean_accepted_prefix']} |")
    base.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    print(f"results: {base}.json / .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
