"""The one validated configuration object for every sparsever knob.

Read from `--speculative-config '{"method": "sparsever", ...}'` or
`LLM(speculative_config={"method": "sparsever", ...})`. Validation happens in the front end,
before the engine starts: an unknown field, a wrong type or an impossible value raises
`SparseverConfigError` naming the field and the allowed values.

Example:
    {"method": "sparsever", "model": "/models/qwen-0.5b", "num_speculative_tokens": 3,
     "attention": {"enabled": false}, "ffn": {"enabled": false}}
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Literal

METHOD_NAME = "sparsever"

# Fields forwarded unchanged to vLLM's SpeculativeConfig (they mean the same thing there).
# Integers end up in int32 kernel arguments and index tensors.
MAX_INT = 2**31 - 1
# Draft tokens (chain) or tree nodes verified per request and step.
MAX_SPECULATIVE_TOKENS = 256

PASSTHROUGH_FIELDS = (
    "draft_tensor_parallel_size",
    "quantization",
    "revision",
    "max_model_len",
    "enforce_eager",
    "disable_padded_drafter_batch",
)


class SparseverConfigError(ValueError):
    """A sparsever config value is invalid; the message names the field and allowed values."""


@dataclass
class AttentionSparsityConfig:
    """Block-sparse attention on verify steps (Quest-style KV block selection).

    Selections are made per request and KV head at anchor layers from per-block key summaries,
    shared by all the request's draft tokens and reused by the layers up to the next anchor.
    """

    enabled: bool = False
    # Context blocks kept per request and KV head, besides the sink and local blocks.
    top_k_blocks: int = 16
    num_sink_blocks: int = 1
    num_local_blocks: int = 1
    # Below this context length (tokens) attention stays dense: nothing to save.
    min_context_len: int = 2048
    # Layers that select blocks; the layers after each anchor reuse its selection.
    # None means "from the calibration profile, else every layer".
    anchor_layers: list[int] | None = None
    # Which kernel attends over the kept blocks (fixed at start):
    # "sparsever": sparsever's block-sparse kernel, one selection per request and KV head; it reads
    #   the plain ("vec") KV layout, so every step of the worker uses vLLM's vec attention ISA.
    # "vllm": vLLM's own CPU attention kernel over a compacted block table, one selection per
    #   request shared by its KV heads; the KV layout (and the ISA of dense steps) stays vLLM's
    #   choice, e.g. AMX tiles for bf16 on Xeons with AMX.
    # "auto": "vllm" where vLLM would pick a non-plain layout (AMX), else "sparsever".
    kernel: Literal["auto", "sparsever", "vllm"] = "auto"
    # Which exact kernel attends on verify steps that attend densely (this section disabled, rows
    # below min_context_len, a hierarchy's full pass); lossless either way, so it applies whether or
    # not `enabled` is set. Decode steps: decode_kernel; prefill always runs vLLM's kernel.
    # "sparsever": block_sparse_tree_attention over all blocks, reading vLLM's KV layout in place
    #   (vec/vec16, and AMX tiles for bf16 on CPUs with AMX);
    # "vllm": vLLM's own kernel;
    # "auto": "sparsever" where it reads the layer's KV layout (the kernel benchmark: it beats vLLM's
    #   kernel at 1-16 query tokens on both layouts), else "vllm".
    dense_kernel: Literal["auto", "sparsever", "vllm"] = "auto"
    # Which exact kernel attends on plain decode steps of the target (one token per row, no verify
    # row, no prefill chunk), e.g. EVICT's steps that skip drafting; prefill stays on vLLM's kernel.
    # "sparsever": block_sparse_tree_attention over every block (as dense verify steps);
    # "vllm": vLLM's own kernel;
    # "auto": "sparsever" on the plain ("vec") KV layouts, where the kernel benchmark has it 1.2-1.9x
    #   faster than vLLM's vec kernel at one token; "vllm" on AMX tiles (a tie there).
    decode_kernel: Literal["auto", "sparsever", "vllm"] = "auto"

    def validate(self, prefix: str) -> None:
        _check_choice(f"{prefix}.kernel", self.kernel, ("auto", "sparsever", "vllm"))
        _check_choice(f"{prefix}.dense_kernel", self.dense_kernel, ("auto", "sparsever", "vllm"))
        _check_choice(f"{prefix}.decode_kernel", self.decode_kernel, ("auto", "sparsever", "vllm"))
        _check_int(f"{prefix}.top_k_blocks", self.top_k_blocks, minimum=1)
        _check_int(f"{prefix}.num_sink_blocks", self.num_sink_blocks, minimum=0)
        _check_int(f"{prefix}.num_local_blocks", self.num_local_blocks, minimum=1)
        _check_int(f"{prefix}.min_context_len", self.min_context_len, minimum=0)
        _check_layer_list(f"{prefix}.anchor_layers", self.anchor_layers)
        if self.anchor_layers is not None and (not self.anchor_layers or self.anchor_layers[0] != 0):
            raise SparseverConfigError(
                f"{prefix}.anchor_layers: must start with layer 0 (the first layer has no selection "
                f"to reuse), got {self.anchor_layers}"
            )


# Used when neither the config nor a calibration profile gives a value.
DEFAULT_FFN_KEEP_RATIO = 0.5
# ffn.gate "auto": gate rows from this size per rank run on the stock packed GEMM: faster for large
# gates, slower for small ones, where the extra call costs more than the packed GEMM saves
# (bench/results/kernels_2026-11-25_ffn_bf16_t2_epyc-zen5-gate*).
FFN_STOCK_GATE_MIN_BYTES = 4 << 20
FFN_GATES = ("auto", "stock", "kernel", "input_sparse")
DEFAULT_MOE_RATIO_THRESHOLD = 0.25


@dataclass
class FFNSparsityConfig:
    """Top-k FFN neuron gating on verify steps (one neuron set per request's verify tokens)."""

    enabled: bool = False
    # Share of intermediate neurons kept, (0, 1], for every layer. None = per-layer ratios from
    # the calibration profile, else DEFAULT_FFN_KEEP_RATIO.
    keep_ratio: float | None = None
    # Verify steps with more requests than this run the dense MLP: per-request neuron sets of many
    # requests union to ~all rows, and the gather kernel then costs more than a dense GEMM.
    max_verify_requests: int = 2
    # CPU: "copy" keeps vLLM's prepacked (oneDNN) MLP for every dense step and a plain copy for the
    # sparse path (+1x MLP weights in memory); "shared" keeps only plain weights (no extra memory;
    # dense steps run the op at keep = I for few tokens, torch's linear beyond, slower than vLLM's
    # packed MLP: docs/kernels.md has the times).
    weights: Literal["shared", "copy"] = "copy"
    # How a verify step's gate projection (every neuron's score) is computed. "stock": densely on the
    # target's own linear (vLLM-CPU's packed GEMM for the gate rows, oneDNN at these sizes, which
    # replace the plain gate copy; torch's linear on GPU), then topk_swiglu_ffn_gated; "kernel":
    # densely by sparsever's op, streaming the plain gate rows itself; "auto": "stock" on CPU for gate
    # rows of at least FFN_STOCK_GATE_MIN_BYTES per rank (where the packed GEMM streams faster,
    # measured in bench/results) with "copy" weights, else "kernel" (with "shared" weights "stock"
    # packs a second copy of the gate rows, +1/3x). "input_sparse": approximately, from each request's
    # top `gate_input_keep_ratio` of hidden channels by summed |x| (TEAL-style; a transposed gate
    # copy replaces the plain gate rows), reading that share of the gate's bytes; the kept neurons'
    # SwiGLU product uses that gate too (more approximate than the neuron selection alone).
    gate: Literal["auto", "stock", "kernel", "input_sparse"] = "auto"
    # "input_sparse" only: share of hidden channels the approximate gate reads, (0, 1].
    gate_input_keep_ratio: float = 0.7
    # The MLP of dense steps with few tokens (decode, dense verify; lossless either way, sparsity on or
    # off), on CPU: "sparsever" runs the FFN op at keep = I (every neuron) over the plain weights,
    # which needs "shared" weights (with FFN sparsity off they are made "shared"); "vllm" keeps the
    # stock MLP (with "shared" weights: its linears on the plain weights); "auto" is "sparsever"
    # with "shared" weights, and with FFN sparsity off on CPUs without AVX-512 for bf16/fp16 targets
    # whose linears stay vLLM's (linear_kernel "vllm": torch's 16-bit linear there, whose time grows with
    # every token: docs/kernels.md, "AVX2"), else "vllm".
    dense_kernel: Literal["auto", "sparsever", "vllm"] = "auto"

    def validate(self, prefix: str) -> None:
        _check_int(f"{prefix}.max_verify_requests", self.max_verify_requests, minimum=1)
        _check_choice(f"{prefix}.weights", self.weights, ("shared", "copy"))
        _check_choice(f"{prefix}.dense_kernel", self.dense_kernel, ("auto", "sparsever", "vllm"))
        if self.dense_kernel == "sparsever" and self.enabled and self.weights == "copy":
            raise SparseverConfigError(
                f"{prefix}.dense_kernel: 'sparsever' runs dense steps on the plain MLP weights, which "
                f"{prefix}.weights 'copy' keeps only for the sparse path; use {prefix}.weights 'shared' "
                f"(allowed with 'copy': 'auto', 'vllm')")
        _check_choice(f"{prefix}.gate", self.gate, FFN_GATES)
        _check_float(f"{prefix}.gate_input_keep_ratio", self.gate_input_keep_ratio, low=0.0, high=1.0,
                     low_open=True)
        if self.keep_ratio is not None:
            _check_float(f"{prefix}.keep_ratio", self.keep_ratio, low=0.0, high=1.0, low_open=True)


@dataclass
class MoESparsityConfig:
    """MoE expert pruning on verify steps, with grouped dispatch over the union of kept experts."""

    enabled: bool = False
    # Drop a token's expert j when its routing weight < ratio_threshold * (top-1 weight), for every
    # layer. None = per-layer medians from the calibration profile, else DEFAULT_MOE_RATIO_THRESHOLD.
    ratio_threshold: float | None = None
    # Cap on distinct experts per verify step (None = no cap), counted per request or over the
    # whole step ("step": the union of every verify request's experts, so it bounds the bytes read).
    expert_budget: int | None = None
    budget_scope: Literal["request", "step"] = "request"
    # Verify steps with more requests than this run the stock MoE (the union of many requests'
    # experts is ~all experts).
    max_verify_requests: int = 4
    # CPU: how the expert weights the sparse path reads are kept. "copy": stock prepacked experts
    # (cpu_fused_moe) for every dense step plus a plain copy (+1x expert weights); "shared":
    # vLLM-CPU's prepack is skipped and dense steps run sparsever's expert kernel on the same
    # tensors (no extra memory).
    weights: Literal["shared", "copy"] = "copy"

    def validate(self, prefix: str) -> None:
        _check_int(f"{prefix}.max_verify_requests", self.max_verify_requests, minimum=1)
        _check_choice(f"{prefix}.weights", self.weights, ("shared", "copy"))
        _check_choice(f"{prefix}.budget_scope", self.budget_scope, ("request", "step"))
        if self.ratio_threshold is not None:
            _check_float(f"{prefix}.ratio_threshold", self.ratio_threshold, low=0.0, high=1.0)
        if self.expert_budget is not None:
            _check_int(f"{prefix}.expert_budget", self.expert_budget, minimum=1)


@dataclass
class AdaptiveVerificationConfig:
    """EVICT: before verification, cut the step's draft trees (or chains) to the prefix-closed part
    whose expected accepted tokens pay for its verification cost (adaptive/evict.py). Benefit: the
    drafter's path probabilities, calibrated online; cost: the profile `vllm-sparsever
    profile-verify MODEL` measured. Lossless (it only drops drafts)."""

    enabled: bool = False
    # Never verify fewer than this many draft tokens per request (0: a step may verify none).
    min_draft_tokens: int = 0
    # Verify-cost profile json. None = <target model folder>/sparsever_verify_cost.json.
    cost_profile: str | None = None
    # Skip drafting when the best depth is 0 (plain decoding pays better), probing now and then.
    guard: bool = True
    # "auto": EVICT chooses how far to draft, before drafting and after each draft pass
    # (num_speculative_tokens / tree.depth are caps); "cap": draft to the cap, EVICT only truncates.
    depth: Literal["auto", "cap"] = "auto"

    def validate(self, prefix: str) -> None:
        _check_int(f"{prefix}.min_draft_tokens", self.min_draft_tokens, minimum=0)
        _check_bool(f"{prefix}.guard", self.guard)
        _check_choice(f"{prefix}.depth", self.depth, ("auto", "cap"))
        if self.cost_profile is not None:
            if not isinstance(self.cost_profile, str) or not os.path.isfile(self.cost_profile):
                raise SparseverConfigError(
                    f"{prefix}.cost_profile: no verify-cost profile at {self.cost_profile!r} (allowed: a json "
                    f"file written by `vllm-sparsever profile-verify MODEL`, or omit it to use the model folder's)"
                )


@dataclass
class DraftTreeConfig:
    """Draft trees (EAGLE-2-style dynamic trees), verified in one target pass under the ancestor
    mask. The node budget is num_speculative_tokens. Each level, the drafter runs the `expand`
    most probable nodes of the newest level and gives each its top-`branching` tokens as children;
    after `depth` levels the num_speculative_tokens most probable nodes (by path probability) are
    kept (a prefix-closed tree). Lossless: greedy output is the target's, and sampling follows the
    target's distribution (candidates are tested one by one against the target's residual)."""

    enabled: bool = False
    branching: int = 3
    expand: int = 3
    depth: int = 5

    def validate(self, prefix: str) -> None:
        for name in ("branching", "expand", "depth"):
            _check_int(f"{prefix}.{name}", getattr(self, name), minimum=1)


@dataclass
class EarlyExitConfig:
    """The target's early exits and hierarchical verification: self-drafting (draft_source=
    'early_exit'), and `enabled`: an intermediate verifier (the target's early layers, or the sparse
    target) checks every round of drafts first, the full target the accumulated tokens periodically."""

    # Self-drafting: the target's first `draft_layer` decoder layers plus the head trained at that
    # layer (`vllm-sparsever train-exits`). None = the shallowest trained head.
    draft_layer: int | None = None
    # Stop drafting a request at the first draft whose head probability is below this (that draft is
    # dropped): dynamic draft length. 0 = always draft num_speculative_tokens.
    draft_confidence: float = 0.0
    # Folder with the trained heads and their manifest.json. None = <target model folder>/exit_heads.
    heads: str | None = None
    # VocabTrim: draft over the target's N most frequent output tokens only (reads N LM head rows per
    # draft token instead of the whole vocabulary). None = the full vocabulary.
    draft_vocab: int | None = None
    # Hierarchical verification: the intermediate verifier checks each round of `round_tokens`
    # drafts; the tokens it accepts (plus its correction) are pending, and the full target verifies
    # all pending tokens (at most num_speculative_tokens) in one pass after `full_verify_every`
    # rounds, when the cap is reached, or at a stop token / max_tokens. Drafts come from any
    # draft_source but 'mtp' (the self-drafter, n-gram prompt lookup, the draft model, or an EAGLE /
    # EAGLE-3 head, run in rounds; a head only over intermediate 'sparse', whose states it reads).
    enabled: bool = False
    # The intermediate verifier: "early_exit" = the first `verify_layer` layers plus their head
    # (None = the deepest trained head); "sparse" = the whole target with the enabled sparse
    # sections (attention/ffn/moe), which then apply to this level only: the full level verifies
    # densely, so sparse verification becomes lossless.
    intermediate: Literal["early_exit", "sparse"] = "early_exit"
    verify_layer: int | None = None
    # Reuse across levels (intermediate 'early_exit' only): the full pass starts at verify_layer from
    # the residual streams the intermediate passes computed (dropping the verifier's last correction,
    # which no pass has run), so it reads verify_layer fewer layers' weights.
    reuse_hidden_states: bool = False
    full_verify_every: int = 4
    round_tokens: int = 3

    def validate(self, prefix: str) -> None:
        for name in ("draft_layer", "verify_layer", "draft_vocab"):
            value = getattr(self, name)
            if value is not None:
                _check_int(f"{prefix}.{name}", value, minimum=1)
        _check_float(f"{prefix}.draft_confidence", self.draft_confidence, low=0.0, high=1.0)
        if self.heads is not None and not isinstance(self.heads, str):
            raise SparseverConfigError(f"{prefix}.heads: expected a folder path (str), got {self.heads!r}")
        _check_int(f"{prefix}.full_verify_every", self.full_verify_every, minimum=1)
        _check_int(f"{prefix}.round_tokens", self.round_tokens, minimum=1)
        _check_choice(f"{prefix}.intermediate", self.intermediate, INTERMEDIATE_VERIFIERS)
        if not self.enabled and self.intermediate != "early_exit":
            raise SparseverConfigError(
                f"{prefix}.intermediate: only used by hierarchical verification; set "
                f"{prefix}.enabled to true (or drop {prefix}.intermediate)"
            )
        _check_bool(f"{prefix}.reuse_hidden_states", self.reuse_hidden_states)
        if self.reuse_hidden_states and not self.uses_heads:
            raise SparseverConfigError(
                f"{prefix}.reuse_hidden_states: needs hierarchical verification with an early-exit "
                f"intermediate verifier ({prefix}.enabled: true, {prefix}.intermediate: 'early_exit')"
            )
        if self.intermediate == "sparse" and self.verify_layer is not None:
            raise SparseverConfigError(
                f"{prefix}.verify_layer: only valid with {prefix}.intermediate='early_exit' (the sparse "
                f"intermediate verifier runs every layer), got verify_layer={self.verify_layer}"
            )

    @property
    def uses_heads(self) -> bool:
        """Whether the intermediate verifier is an exit head (hierarchical, 'early_exit')."""
        return self.enabled and self.intermediate == "early_exit"


# vLLM's model-based drafters that vLLM runs as they are (sparsever verifies their drafts): an EAGLE /
# EAGLE-3 head (`model`: its folder), or the target's own multi-token-prediction layers.
VLLM_DRAFTERS = ("eagle", "eagle3", "mtp")
# vLLM drafters whose head sparsever runs itself in the hierarchy (drafting/eagle_head.py).
EAGLE_HEAD_SOURCES = ("eagle", "eagle3")
# "none": drafting off, every step a plain decode step on sparsever's engine and kernels (the kernels-only
# baseline of the benchmarks; the state EVICT's guard switches a step to).
DRAFT_SOURCES = ("draft_model", "ngram", "early_exit", *VLLM_DRAFTERS, "none")
INTERMEDIATE_VERIFIERS = ("early_exit", "sparse")
TREE_DRAFT_SOURCES = ("draft_model", "early_exit", "eagle", "eagle3")  # drafters with probabilities to grow trees by
# EVICT chains from n-gram matches too (calibrated per depth), and vLLM's drafters' chains (their probabilities)
ADAPTIVE_DRAFT_SOURCES = ("draft_model", "ngram", "early_exit", "eagle", "eagle3", "mtp")


@dataclass
class SparseverConfig:
    """Every sparsever field. Defaults mean "off": dense verification, plain speculative decoding."""

    num_speculative_tokens: int
    # Draft source: a separate draft model ("model" set), n-gram prompt lookup, the target's own
    # first layers plus a trained exit head ("early_exit", see the early_exit section), or one of
    # vLLM's own model-based drafters (VLLM_DRAFTERS: "eagle"/"eagle3" with `model` the head's
    # folder, "mtp" the target's MTP layers), or "none": no drafting at all.
    draft_source: Literal["draft_model", "ngram", "early_exit", "eagle", "eagle3", "mtp", "none"] = "draft_model"
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # draft_source='draft_model' with sparsever's drafter (adaptive, tree or early_exit enabled): the
    # draft model drafts over this many lowest token ids plus the stop tokens and every token of the
    # live requests (drafting/draft_vocab.py), reading that part of its LM head only. Lossless. None:
    # the whole vocabulary. (The self-drafter's is early_exit.draft_vocab.)
    draft_vocab: int | None = None
    # draft_source='draft_model' under sparsever's drafter, as draft_vocab: the draft model's passes
    # attend to the context's first KV block and its last N positions only (StreamingLLM-style sink +
    # window, whole blocks), and its catch-ups run no other stale position. Lossless (drafts only).
    # None: the whole context.
    draft_attention_window: int | None = None
    attention: AttentionSparsityConfig = field(default_factory=AttentionSparsityConfig)
    ffn: FFNSparsityConfig = field(default_factory=FFNSparsityConfig)
    moe: MoESparsityConfig = field(default_factory=MoESparsityConfig)
    adaptive: AdaptiveVerificationConfig = field(default_factory=AdaptiveVerificationConfig)
    tree: DraftTreeConfig = field(default_factory=DraftTreeConfig)
    early_exit: EarlyExitConfig = field(default_factory=EarlyExitConfig)
    # Calibration profile (json from `vllm-sparsever calibrate`) with anchor layers and
    # thresholds. None = the target model's default profile if one was calibrated, else the
    # built-in defaults; "none" = never read a profile.
    profile: str | None = None
    # On a run-time problem with a sparse path, verify densely (and warn) instead of failing.
    fallback_to_dense: bool = True
    # The target's dense linear layers on CPU (lossless, a start-up choice): "sparsever" keeps their
    # weights plain and runs sparsever's dense_linear op (weights streamed for few tokens, fp32 GEMM
    # panels for more); "hybrid" runs dense_linear for steps of a few tokens (decode, drafts, verify)
    # and vLLM-CPU's packed weights for more (prefill), holding each weight twice; "vllm" keeps
    # vLLM-CPU's own; "vllm-padded" keeps it and runs calls of 1-3 tokens as 4-row calls (oneDNN
    # reads 16-bit weights faster for 4 rows than for 1-3 on AVX512-BF16 CPUs without AMX); "auto" is
    # "sparsever" for bf16/fp16 targets on CPUs without AVX-512, where vLLM-CPU's 16-bit linear is
    # torch's, "vllm-padded" for them on AVX512-BF16 CPUs without AMX (verification/lossless/linear_kernel.py), else
    # "vllm". The draft model's (or head's) linears follow.
    linear_kernel: Literal["auto", "sparsever", "hybrid", "vllm", "vllm-padded"] = "auto"
    # A draft model's int8 (W8A8: per-row weight scales, activations quantized per token) linears on
    # CPU: "sparsever" runs sparsever's int8_linear op (each int8 row read once per call, for every
    # token, on VNNI dot products); "hybrid" runs it for calls of up to 3 tokens and vLLM-CPU's GEMM for
    # longer ones, holding each int8 weight twice; "vllm" keeps vLLM-CPU's (oneDNN's int8 GEMM, or
    # sgl-kernel's on AMX); "auto" is "hybrid" for a quantized draft on a CPU with VNNI where a
    # one-token call of the op is measured faster than vLLM-CPU's at start, else "vllm"
    # (verification/lossless/linear_kernel.py). Lossless either way: the target verifies.
    draft_int8_kernel: Literal["auto", "sparsever", "hybrid", "vllm"] = "auto"
    # A draft model's int4 (symmetric, groups of a multiple of 128 input channels) linears on CPU:
    # "sparsever" runs sparsever's int4_linear op (W4A8: activations quantized per token, VNNI dot
    # products) for every call; "hybrid" for calls of up to 32 tokens and vLLM-CPU's int4 GEMM for longer
    # ones (holding each int4 weight twice); "vllm" keeps vLLM-CPU's (W4A16, or W4A8 on AMX); "auto" is
    # "hybrid" for a quantized draft on a CPU with VNNI and without AMX, else "vllm". Lossless either
    # way: the target verifies.
    draft_int4_kernel: Literal["auto", "sparsever", "hybrid", "vllm"] = "auto"
    # vLLM SpeculativeConfig fields forwarded as they are.
    passthrough: dict[str, Any] = field(default_factory=dict)

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "SparseverConfig":
        """Build and validate from the user's speculative-config dict (with or without "method")."""
        if not isinstance(raw, dict):
            raise SparseverConfigError(
                f"speculative_config must be a JSON object, got {type(raw).__name__}"
            )
        raw = {k.replace("-", "_"): v for k, v in raw.items()}
        method = raw.pop("method", METHOD_NAME)
        if method != METHOD_NAME:
            raise SparseverConfigError(f"method: expected {METHOD_NAME!r}, got {method!r}")

        sections = SECTIONS
        top_level = {f.name for f in dataclasses.fields(cls)} - {"passthrough"}
        allowed = sorted(top_level | set(PASSTHROUGH_FIELDS))
        kwargs: dict[str, Any] = {}
        passthrough: dict[str, Any] = {}
        for key, value in raw.items():
            if key in sections:
                kwargs[key] = _section_from_dict(key, sections[key], value)
            elif key in top_level:
                kwargs[key] = value
            elif key in PASSTHROUGH_FIELDS:
                passthrough[key] = value
            else:
                raise SparseverConfigError(
                    f"unknown field {key!r} in the sparsever speculative_config; "
                    f"allowed fields: {', '.join(allowed)}"
                )
        if "num_speculative_tokens" not in kwargs and kwargs.get("draft_source") == "none":
            kwargs["num_speculative_tokens"] = 1  # vLLM's spec-decode config wants >= 1; nothing is drafted
        if "num_speculative_tokens" not in kwargs:
            raise SparseverConfigError(
                "num_speculative_tokens: required (an integer >= 1, the number of draft tokens per step)"
            )
        if "draft_source" not in kwargs:
            kwargs["draft_source"] = "draft_model" if kwargs.get("model") else "ngram"
        config = cls(**kwargs, passthrough=passthrough)
        config.validate()
        return config

    @staticmethod
    def section_from_dict(name: str, value: Any) -> Any:
        """One section (e.g. "attention") built and validated on its own: the run-time switch of
        the sparse sections, whose cross-section rules were checked at start."""
        section = _section_from_dict(name, SECTIONS[name], value)
        _check_bool(f"{name}.enabled", section.enabled)
        section.validate(name)
        return section

    def validate(self) -> None:
        _check_int("num_speculative_tokens", self.num_speculative_tokens, minimum=1,
                   maximum=MAX_SPECULATIVE_TOKENS)
        _check_choice("draft_source", self.draft_source, DRAFT_SOURCES)
        if self.draft_source != "ngram":
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise SparseverConfigError(
                        f"{name}: only valid with draft_source='ngram', got draft_source={self.draft_source!r}"
                    )
        if self.draft_source in ("draft_model", "eagle", "eagle3"):
            if not isinstance(self.model, str) or not self.model:
                what = "the draft model" if self.draft_source == "draft_model" else f"the {self.draft_source} head"
                raise SparseverConfigError(
                    f"model: required with draft_source={self.draft_source!r} (path or name of {what}); "
                    "omit it and set draft_source='ngram' for n-gram prompt lookup"
                )
        elif self.draft_source == "mtp":
            if self.model is not None:
                raise SparseverConfigError(
                    "model: must be omitted with draft_source='mtp' (the target drafts with its own "
                    "multi-token-prediction layers)"
                )
        elif self.draft_source == "early_exit":
            if self.model is not None:
                raise SparseverConfigError(
                    "model: must be omitted with draft_source='early_exit' (the target drafts for "
                    "itself with its first layers and a trained exit head)"
                )
        elif self.draft_source == "none":
            if self.model is not None:
                raise SparseverConfigError("model: must be omitted with draft_source='none' (drafting is off)")
            if self.early_exit.enabled:
                raise SparseverConfigError(
                    "early_exit.enabled: hierarchical verification verifies drafts, and draft_source='none' "
                    "drafts nothing (allowed: early_exit.enabled=false)"
                )
        else:
            if self.model is not None:
                raise SparseverConfigError(
                    "model: must be omitted with draft_source='ngram' (n-gram drafting uses no model)"
                )
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                value = getattr(self, name)
                if value is not None:
                    _check_int(name, value, minimum=1)
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is not None and hi is not None and lo > hi:
                raise SparseverConfigError(
                    f"prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})"
                )
        ee = self.early_exit
        for name in ("draft_vocab", "draft_attention_window"):
            if getattr(self, name) is None:
                continue
            _check_int(name, getattr(self, name), minimum=1)
            if self.draft_source != "draft_model":
                other = " (the self-drafter's is early_exit.draft_vocab)" if name == "draft_vocab" else ""
                raise SparseverConfigError(
                    f"{name}: only valid with draft_source='draft_model'{other}, got draft_source={self.draft_source!r}"
                )
            if not (self.adaptive.enabled or self.tree.enabled or ee.enabled):
                raise SparseverConfigError(
                    f"{name}: vLLM's own draft_model proposer runs the draft model as it is; sparsever runs it "
                    "with adaptive.enabled, tree.enabled or early_exit.enabled (set one)"
                )
        if self.draft_source != "early_exit":
            for name in ("draft_layer", "draft_vocab", "draft_confidence"):
                default = 0.0 if name == "draft_confidence" else None
                if getattr(ee, name) != default:
                    raise SparseverConfigError(
                        f"early_exit.{name}: only valid with draft_source='early_exit', "
                        f"got draft_source={self.draft_source!r}"
                    )
            if ee.heads is not None and not ee.uses_heads:
                raise SparseverConfigError(
                    "early_exit.heads: only valid when exit heads are used (draft_source='early_exit', "
                    f"or early_exit.enabled with intermediate='early_exit'), got draft_source="
                    f"{self.draft_source!r}"
                )
        if ee.enabled and self.draft_source in VLLM_DRAFTERS and self.draft_source not in EAGLE_HEAD_SOURCES:
            raise SparseverConfigError(
                f"early_exit.enabled: hierarchical verification drafts in rounds after pending tokens, which "
                f"vLLM's {self.draft_source} drafter cannot do; allowed draft_source with early_exit.enabled: "
                "'draft_model', 'ngram', 'early_exit', 'eagle', 'eagle3'"
            )
        if ee.enabled and self.draft_source in EAGLE_HEAD_SOURCES and ee.intermediate != "sparse":
            raise SparseverConfigError(
                f"early_exit.intermediate: an {self.draft_source} head drafts each round from the target's states of "
                f"the pending tokens, which only the sparse target computes (allowed with draft_source="
                f"{self.draft_source!r}: 'sparse'), got {ee.intermediate!r}"
            )
        if ee.enabled and ee.intermediate == "sparse" and not self.any_sparsity:
            raise SparseverConfigError(
                "early_exit.intermediate: 'sparse' verifies with the sparse target, but no sparse "
                "section is enabled (enable attention, ffn or moe)"
            )
        if self.profile is not None:
            if not isinstance(self.profile, str):
                raise SparseverConfigError(
                    "profile: expected a path to a calibration profile json, or 'none'"
                )
            if self.profile != "none" and not os.path.isfile(self.profile):
                raise SparseverConfigError(
                    f"profile: no calibration profile at {self.profile!r} (allowed: an existing "
                    f"json file written by `vllm-sparsever calibrate`, or 'none')"
                )
        _check_bool("fallback_to_dense", self.fallback_to_dense)
        _check_choice("linear_kernel", self.linear_kernel, ("auto", "sparsever", "hybrid", "vllm", "vllm-padded"))
        _check_choice("draft_int8_kernel", self.draft_int8_kernel, ("auto", "sparsever", "hybrid", "vllm"))
        _check_choice("draft_int4_kernel", self.draft_int4_kernel, ("auto", "sparsever", "hybrid", "vllm"))
        for name in ("attention", "ffn", "moe", "adaptive", "tree", "early_exit"):
            section = getattr(self, name)
            _check_bool(f"{name}.enabled", section.enabled)
            section.validate(name)
        for name, sources in (("tree", TREE_DRAFT_SOURCES), ("adaptive", ADAPTIVE_DRAFT_SOURCES)):
            if not getattr(self, name).enabled:
                continue
            if self.draft_source not in sources:
                raise SparseverConfigError(
                    f"{name}.enabled: {'draft trees' if name == 'tree' else 'adaptive verification'} take drafts "
                    f"from draft_source {', '.join(repr(s) for s in sources)} in this version, got "
                    f"draft_source={self.draft_source!r}"
                )
            if ee.enabled:
                raise SparseverConfigError(
                    f"{name}.enabled: not combined with hierarchical verification "
                    f"(allowed: early_exit.enabled=false with {name}.enabled=true)"
                )
        if (self.tree.enabled or self.adaptive.enabled) and ee.draft_confidence:
            raise SparseverConfigError(
                "early_exit.draft_confidence: not used with draft trees or adaptive verification (the drafter's "
                "probabilities and EVICT decide what is verified); allowed: 0"
            )
        if self.tree.enabled:
            if self.attention.enabled and self.attention.kernel == "vllm":
                raise SparseverConfigError(
                    "attention.kernel: 'vllm' has no tree mask; with tree.enabled use 'sparsever' or 'auto'"
                )

    # ---- mapping onto vLLM --------------------------------------------------------------

    def to_vllm_speculative_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of vLLM's SpeculativeConfig for the method that drives drafting."""
        kwargs: dict[str, Any] = dict(self.passthrough)
        kwargs["num_speculative_tokens"] = self.num_speculative_tokens
        if self.draft_source in ("draft_model", "eagle", "eagle3"):
            kwargs["method"] = self.draft_source
            kwargs["model"] = self.model
        elif self.draft_source == "mtp":
            kwargs["method"] = "mtp"
        else:
            # n-gram drafting, and self-drafting, which vLLM drives like its n-gram drafter (CPU
            # token lists in, draft lists out, no draft model; the sparsever runner replaces the
            # proposal with the self-drafter's, and the prompt-lookup fields are unset).
            kwargs["method"] = "ngram"
            if self.prompt_lookup_min is not None:
                kwargs["prompt_lookup_min"] = self.prompt_lookup_min
            if self.prompt_lookup_max is not None:
                kwargs["prompt_lookup_max"] = self.prompt_lookup_max
        return kwargs

    @property
    def any_sparsity(self) -> bool:
        return self.attention.enabled or self.ffn.enabled or self.moe.enabled

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_serialized(cls, data: dict[str, Any]) -> "SparseverConfig":
        """Rebuild from `to_dict()` output (as carried in VllmConfig.additional_config)."""
        data = dict(data)
        passthrough = data.pop("passthrough", {})
        raw = {**data, **passthrough}
        return cls.from_dict(raw)


SECTIONS: dict[str, type] = {
    "attention": AttentionSparsityConfig,
    "ffn": FFNSparsityConfig,
    "moe": MoESparsityConfig,
    "adaptive": AdaptiveVerificationConfig,
    "tree": DraftTreeConfig,
    "early_exit": EarlyExitConfig,
}

# ---- helpers ------------------------------------------------------------------------------


def _section_from_dict(name: str, section_cls: type, value: Any) -> Any:
    if isinstance(value, bool):  # shorthand: "ffn": true
        return section_cls(enabled=value)
    if not isinstance(value, dict):
        raise SparseverConfigError(
            f"{name}: expected an object with fields {_field_names(section_cls)} or a boolean, "
            f"got {value!r}"
        )
    known = _field_names(section_cls)
    for key in value:
        if key not in known:
            raise SparseverConfigError(
                f"unknown field {name}.{key!r}; allowed fields of {name}: {', '.join(known)}"
            )
    return section_cls(**value)


def _field_names(section_cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(section_cls)]


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise SparseverConfigError(f"{name}: expected true or false, got {value!r}")


def _check_int(name: str, value: Any, minimum: int | None = None, maximum: int = MAX_INT) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SparseverConfigError(f"{name}: expected an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise SparseverConfigError(f"{name}: must be an integer >= {minimum}, got {value}")
    if value > maximum:
        raise SparseverConfigError(f"{name}: must be an integer <= {maximum}, got {value}")


def _check_float(
    name: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SparseverConfigError(f"{name}: expected a number, got {value!r}")
    if not math.isfinite(value):
        raise SparseverConfigError(f"{name}: expected a finite number, got {value!r}")
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and value > high
    if too_low or too_high:
        lo = "(" if low_open else "["
        bounds = f"{lo}{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"
        raise SparseverConfigError(f"{name}: must be in {bounds}, got {value}")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise SparseverConfigError(
            f"{name}: must be one of {', '.join(repr(c) for c in choices)}, got {value!r}"
        )


def _check_layer_list(name: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_INT for v in value
    ):
        raise SparseverConfigError(f"{name}: expected a list of layer indices >= 0, got {value!r}")
    if sorted(set(value)) != value:
        raise SparseverConfigError(f"{name}: layer indices must be strictly increasing, got {value}")
