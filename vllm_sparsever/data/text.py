"""Plain-text readers for the raw corpora: Lee news (gensim), a Wikipedia XML dump, Gutenberg plays."""

from __future__ import annotations

import bz2
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


def read_lines(path: Path) -> list[str]:
    """One document per line (gensim's `.cor` format); latin-1 safe."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("latin-1")
    return [line.strip() for line in text.splitlines() if line.strip()]


@dataclass(frozen=True)
class WikiArticle:
    title: str
    page_id: str
    text: str


_WIKI_SKIP_LINK_PREFIXES = ("file:", "image:", "category:", "media:")
_WIKI_END_SECTIONS = re.compile(
    r"^(see also|references|notes|further reading|external links|bibliography|sources|footnotes)$", re.I
)


def clean_wikitext(wikitext: str) -> str:
    """Readable prose from wikitext: no templates, references, files, tables or trailing apparatus."""
    import mwparserfromhell

    code = mwparserfromhell.parse(wikitext)
    _remove_nodes(code, [tag for tag in code.filter_tags(recursive=False)
                         if str(tag.tag).lower() in ("ref", "gallery", "math", "table", "timeline")])
    _remove_nodes(code, [link for link in code.filter_wikilinks()
                         if str(link.title).strip().lower().startswith(_WIKI_SKIP_LINK_PREFIXES)])
    paragraphs = []
    for section_text in _sections_until_back_matter(code):
        paragraphs.append(section_text)
    text = "\n\n".join(paragraphs)
    text = re.sub(r"\(\s*[,;]?\s*\)", "", text)  # "Albedo ()" left by removed pronunciation templates
    text = re.sub(r"[ \t]+", " ", text)
    text = re.sub(r" ([,.;:])", r"\1", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def _remove_nodes(code, doomed: list) -> None:
    """Remove these nodes (by identity) wherever they sit in `code`, in one walk of the tree: what
    `code.remove(node)` per node does, without its search of the whole tree for each node. A node
    inside a removed one goes with it."""
    doomed_ids = {id(node) for node in doomed}
    if not doomed_ids:
        return

    def walk(wikicode) -> None:
        nodes = wikicode.nodes
        for i in reversed(range(len(nodes))):
            if id(nodes[i]) in doomed_ids:
                nodes.pop(i)
        for node in nodes:
            for child in node.__children__():
                walk(child)

    walk(code)


def _sections_until_back_matter(code) -> Iterator[str]:
    """Cleaned text of each section, stopping at the first back-matter heading (See also, ...)."""
    sections = code.get_sections(include_lead=True, flat=True)
    for section in sections:
        headings = section.filter_headings(recursive=False)
        title = headings[0].title.strip_code().strip() if headings else ""
        if title and _WIKI_END_SECTIONS.match(title):
            return
        _remove_nodes(section, headings)
        body = section.strip_code(normalize=True, collapse=True).strip()
        body = "\n".join(line for line in body.splitlines() if not line.lstrip().startswith(("|", "!", "{|")))
        if body:
            yield (f"{title}\n\n{body}" if title else body).strip()


def read_wikipedia_dump(path: Path) -> list[WikiArticle]:
    """Main-namespace, non-redirect articles of a (bz2) MediaWiki XML export, in file order."""
    opener = bz2.open if path.suffix == ".bz2" else open
    articles = []
    with opener(path, "rb") as f:
        for _, element in ET.iterparse(f):
            if not element.tag.endswith("}page"):
                continue
            namespace = element.findtext("{*}ns")
            title = element.findtext("{*}title") or ""
            page_id = element.findtext("{*}id") or ""
            wikitext = element.findtext("{*}revision/{*}text") or ""
            is_redirect = element.find("{*}redirect") is not None or wikitext.lstrip().lower().startswith("#redirect")
            if namespace == "0" and not is_redirect:
                text = clean_wikitext(wikitext)
                if text:
                    articles.append(WikiArticle(title, page_id, text))
            element.clear()
    return articles


def split_sentences(text: str) -> list[str]:
    """A light sentence splitter, good enough for choosing cloze sentences."""
    parts = re.split(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])", text.replace("\n", " "))
    return [p.strip() for p in parts if p.strip()]


def leading_paragraphs(text: str, max_chars: int) -> str:
    """The longest prefix of `text` of at most `max_chars` that ends at a sentence or paragraph
    end (at least one sentence). Always a true prefix, so `text[len(result):]` is the rest."""
    ends = [m.start() for m in re.finditer(r"(?<=[.!?])\s|\n\n", text)] + [len(text)]
    fitting = [e for e in ends if 0 < e <= max_chars]
    return text[: fitting[-1] if fitting else ends[0]].rstrip()
