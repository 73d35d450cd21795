"""The committed leaderboards are today's rendering of the committed results: every
``results/*/leaderboard.html`` and ``leaderboard.md`` is what ``tta-bench leaderboard
<folder> --suite <suite>`` writes from the results files beside it (with the installed
catalogues: families and provenance links), and the PNG files beside them are exactly the
figures the page shows. Rendering only: no method runs and no figure is drawn."""

from __future__ import annotations

from pathlib import Path

import pytest

from tta_bench.report import leaderboard as report

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
    # the protocol it ranks, from its markdown (a board of orders ranks its own protocol)
    text = (folder / report.LEADERBOARD_MD).read_text(encoding="utf-8")
    protocol = next(line for line in text.splitlines() if line.startswith("Protocol `"))
    protocol_id = protocol.split("`")[1]
    board = report.collect(folder, suite, protocol_id)
    figures = report.leaderboard_figures(board)
    again = (
        f"regenerate it: tta-bench leaderboard {folder.relative_to(ROOT)} --suite {suite} "
        f"--protocol {protocol_id}"
    )
    html = report.leaderboard_html(board, images=figures)
    assert page.read_text(encoding="utf-8") == html, f"{page.name} is stale; {again}"
    markdown = report.leaderboard_markdown(board, images=figures)
    md = folder / report.LEADERBOARD_MD
    assert md.read_text(encoding="utf-8") == markdown, f"{md.name} is stale; {again}"
    assert {p.name for p in folder.glob("*.png")} == {f.file for f in figures}, again


#: The methods ranked on digits-open: five closed-set references, the open-set family and
#: the 2025 cache successors (tests/test_open_set_results.py checks each run).
OPEN_RANKED = {
    "zeroshot", "tent", "tda", "mura", "lora",
    "ostta", "sotta", "unient", "stamp", "cliptta", "zsntta", "rosita",
    "mcp", "oga", "tca", "cosmic",
}  # fmt: skip


def test_the_open_set_suite_has_three_seeds_of_its_methods_ranked():
    """digits-open: every ranked method with 3 seeds, every cell open-set (180 known + 180
    unknown digits) with AUROC / AUPR / FPR95, all on the leaderboard, and the per-shift
    tables of the open-set methods' own score."""
    folder = ROOT / "results" / "digits-open"
    board = report.collect(folder, "digits-open")
    methods = {e.record["method"] for e in board.entries}
    assert methods == OPEN_RANKED
    for entry in board.entries:
        cells = entry.record["cells"]
        assert sorted({c["seed"] for c in cells}) == [0, 1, 2] and len(cells) == 45
        assert all(c["n_known"] == 180 and c["n_ood"] == 180 for c in cells)
        assert all(0 <= c[m] <= 1 for c in cells for m in ("auroc", "aupr", "fpr95"))
        assert entry.record["metric_bins"]["ece20"] == {
            "count": 20,
            "width": "equal",
            "interval": "(lo, hi]",
            "confidence": "max softmax probability",
        }
    markdown = (folder / report.LEADERBOARD_MD).read_text(encoding="utf-8")
    assert "AUROC %" in markdown and "## AUROC (%) per shift" in markdown
    page = (folder / report.LEADERBOARD_HTML).read_text(encoding="utf-8")
    assert "## AUROC own (%) per shift" in markdown
    for name in ("ece", "ece20", "auroc", "aupr", "fpr95", "auroc_own"):  # the page too
        assert f'<table id="per-shift-{name}-table"' in page
