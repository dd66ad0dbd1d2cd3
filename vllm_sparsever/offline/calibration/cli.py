"""`vllm-sparsever calibrate MODEL`; the lead's CLI calls `add_subparser`."""

from __future__ import annotations

import argparse

from vllm_sparsever.offline.args import positive_int


def add_subparser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from vllm_sparsever.offline.calibration.options import (
        DEFAULT_DATA,
        DTYPE_NAMES,
        CalibrationOptions,
    )

    d = CalibrationOptions()
    parser = subparsers.add_parser(
        "calibrate",
        help="measure anchor layers, FFN keep ratios and MoE thresholds; write the model's profile",
        description="Runs the target model with HF transformers (CPU) on calibration text and writes "
        "the calibration profile that sparse verification reads by default.",
    )
    parser.add_argument("model", help="built model name or model folder (as given to vLLM)")
    parser.add_argument("--output", default=None,
                        help="profile path (default: the model's default profile path)")
    parser.add_argument("--data", nargs="+", default=list(DEFAULT_DATA),
                        help="data-set categories to take text from, in order (default: wikipedia)")
    parser.add_argument("--text-file", default=None, help="calibration text from this file instead")
    parser.add_argument("--max-tokens", type=positive_int, default=None,
                        help=f"calibration tokens (default: {d.max_tokens}, or the model's maximum length if less)")
    parser.add_argument("--dtype", default=d.dtype, choices=list(DTYPE_NAMES))
    parser.add_argument("--num-draft-tokens", type=positive_int, default=d.num_draft_tokens,
                        help="k: a verify window is k+1 tokens")
    parser.add_argument("--block-size", type=positive_int, default=d.block_size)
    parser.add_argument("--top-k-blocks", type=positive_int, default=d.top_k_blocks)
    parser.add_argument("--num-sink-blocks", type=int, default=d.num_sink_blocks)
    parser.add_argument("--num-local-blocks", type=int, default=d.num_local_blocks)
    parser.add_argument("--min-context-len", type=int, default=d.min_context_len,
                        help="verify windows start at this context length when the text allows")
    parser.add_argument("--num-windows", type=positive_int, default=d.num_windows)
    parser.add_argument("--min-jaccard", type=float, default=d.min_jaccard,
                        help="a layer reuses the anchor's blocks at this mean Jaccard similarity")
    parser.add_argument("--ffn-mass", type=float, default=d.ffn_mass,
                        help="share of the summed |silu(gate)| the kept neurons must cover")
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(func=_cmd_calibrate)
    return parser


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from vllm_sparsever.models import resolve_model_arg
    from vllm_sparsever.models.limits import fit_length, model_max_len
    from vllm_sparsever.offline.calibration.calibrate import calibrate, summary
    from vllm_sparsever.offline.calibration.options import CalibrationOptions

    model = resolve_model_arg(args.model, "MODEL")
    max_tokens = fit_length("calibrate", "--max-tokens", args.max_tokens, CalibrationOptions().max_tokens,
                            model_max_len(model))
    options = CalibrationOptions(
        max_tokens=max_tokens,
        num_draft_tokens=args.num_draft_tokens,
        block_size=args.block_size,
        top_k_blocks=args.top_k_blocks,
        num_sink_blocks=args.num_sink_blocks,
        num_local_blocks=args.num_local_blocks,
        min_context_len=args.min_context_len,
        num_windows=args.num_windows,
        min_jaccard=args.min_jaccard,
        ffn_mass=args.ffn_mass,
        dtype=args.dtype,
        data=tuple(args.data),
        text_file=args.text_file,
        show_progress=not args.no_progress,
    )
    result = calibrate(model, options, args.output)
    print(summary(result), flush=True)
    return 0
