"""The committed leaderboards are today's rendering of the committed results: every
``results/*/leaderboard.html`` and ``leaderboard.md`` is what ``tta-bench leaderboard
<folder> --suite <suite>`` writes from the results files beside it (with the installed
catalogues: families and provenance links), and the PNG files beside them are exactly the
figures the page shows. Rendering only: no method runs and no figure is drawn."""

from __future__ import annotations

from pathlib import Path

import pytest

from tta_bench import report

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(ROOT.glob(f"results/*/{report.LEADERBOARD_HTML}"))


def _suite(folder: Path) -> str:
    """The suite a committed leaderboard ranks, from its markdown's title."""
    title = (folder / report.LEADERBOARD_MD).read_text(encoding="utf-8").splitlines()[0]
    assert title.startswith("# Leaderboard: "), title
    return title.removeprefix("# Leaderboard: ").strip()


def test_the_default_suites_leaderboards_are_committed():
    folders = {p.parent.name for p in PAGES}
    assert {"digits-c", "digits-c-continual"} <= folders


@pytest.mark.parametrize("page", PAGES, ids=[p.parent.name for p in PAGES])
def test_a_committed_leaderboard_is_the_current_rendering(page):
    folder = page.parent
    suite = _suite(folder)
    board = report.collect(folder, suite)
    figures = report.leaderboard_figures(board)
    again = f"regenerate it: tta-bench leaderboard {folder.relative_to(ROOT)} --suite {suite}"
    html = report.leaderboard_html(board, images=figures)
    assert page.read_text(encoding="utf-8") == html, f"{page.name} is stale; {again}"
    markdown = report.leaderboard_markdown(board, images=figures)
    md = folder / report.LEADERBOARD_MD
    assert md.read_text(encoding="utf-8") == markdown, f"{md.name} is stale; {again}"
    assert {p.name for p in folder.glob("*.png")} == {f.file for f in figures}, again
