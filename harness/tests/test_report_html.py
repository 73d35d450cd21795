"""The leaderboard page (``report.leaderboard_html``, the Jinja2 template
``tta_bench/report/templates_html/leaderboard.html.j2``) from the fixed results in
``harness/tests/golden/``: self-contained (no script, style or font fetched), the summary
with the columns a reader decides by and the cost details one click away, the per-shift
table in its own scrolling box with the method column fixed, families and provenance
links from the catalogue only, everything escaped, and the figures that fit the suite
(removing the ones that no longer do). The page in a real browser is the plugin's
``tests/test_leaderboard_browser.py``."""

from __future__ import annotations

import json
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tta_bench import catalog
from tta_bench.report import leaderboard as report
from tta_bench.report import plots

from .helpers import GOLDEN


def _write(d: Path, name: str, record: dict) -> None:
    (d / name).write_text(json.dumps(record), encoding="utf-8")


@pytest.fixture()
def results_dir(tmp_path):
    """The golden zero-shot run and the golden adapting run under the test plugin's
    ``norm_tent`` (its catalogue entry declares a family and provenance links)."""
    d = tmp_path / "results"
    d.mkdir()
    shutil.copy(GOLDEN / "golden_zeroshot.json", d / "zeroshot.json")
    tent = json.loads((GOLDEN / "golden_tent.json").read_text())
    _write(d, "norm_tent.json", {**tent, "method": "norm_tent"})
    return d


class _Page(HTMLParser):
    """Tags with their attributes, the text of each table's header cells, which tables
    sit inside a ``<details>`` or a ``.scroll`` box, and the inline script and style."""

    def __init__(self, text: str):
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.headers: dict[str, list[str]] = {}
        self.inside: dict[str, set[str]] = {}
        self.inline: dict[str, str] = {"script": "", "style": ""}
        self._open: list[tuple[str, dict[str, str]]] = []
        self._table: str | None = None
        self._th: list[str] | None = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = {k: v or "" for k, v in attrs}
        self.tags.append((tag, attrs))
        if tag == "table":
            self._table = attrs.get("id", "")
            self.headers[self._table] = []
            self.inside[self._table] = {
                t if t == "details" else a.get("class", "")
                for t, a in self._open
                if t == "details" or "scroll" in a.get("class", "").split()
            }
        if tag == "th":
            self._th = []
        if tag not in ("meta", "input", "img", "br", "link"):
            self._open.append((tag, attrs))

    def handle_endtag(self, tag):
        if tag == "th" and self._th is not None and self._table is not None:
            self.headers[self._table].append("".join(self._th).strip())
            self._th = None
        if tag == "table":
            self._table = None
        while self._open:
            if self._open.pop()[0] == tag:
                break

    def handle_data(self, data):
        if self._th is not None:
            self._th.append(data)
        if self._open and self._open[-1][0] in self.inline:
            self.inline[self._open[-1][0]] += data


def _page(results_dir: Path, **kwargs) -> tuple[str, _Page]:
    board = report.collect(results_dir, "golden")
    text = report.leaderboard_html(board, **kwargs)
    return text, _Page(text)


def test_the_page_is_one_self_contained_file(results_dir):
    report.write_leaderboard(results_dir, "golden", with_plots=plots.available())
    text = (results_dir / report.LEADERBOARD_HTML).read_text(encoding="utf-8")
    page = _Page(text)
    assert not [a for t, a in page.tags if t == "link"]  # no stylesheet, icon or font
    assert not [a for t, a in page.tags if t == "script" and "src" in a]
    assert page.inline["script"].strip() and page.inline["style"].strip()
    for source in ("http:", "https:", "//", "@import", "url("):
        assert source not in page.inline["style"]
    assert "http" not in page.inline["script"] and "fetch(" not in page.inline["script"]
    images = [a["src"] for t, a in page.tags if t == "img"]
    if plots.available():
        assert images and all((results_dir / src).is_file() for src in images)
        assert images[0] == report.PLOT_FOREST  # the headline figure comes first
    assert all("/" not in src for src in images)  # beside the page, by relative path


def test_the_summary_holds_what_a_reader_decides_by_and_the_rest_is_one_click_away(
    results_dir,
):
    _, page = _page(results_dir, images=False)
    assert page.headers["summary-table"] == [
        "rank",
        "method",
        "family",
        "accuracy % (95% CI)",
        "Δ vs zeroshot (95% CI)",
        "p",
        "ECE %",
        "NLL",
        "ms/sample",
        "peak MB",
        "links",
    ]
    assert page.inside["summary-table"] == set()  # not folded, not in a bordered box
    cost = page.headers["cost-table"]
    assert {"data ms", "adapt ms", "predict ms", "trainable params", "model", "seeds"} <= set(cost)
    assert "details" in page.inside["cost-table"]
    shift = page.headers["shift-table"]
    assert shift == ["method", "gaussian_noise", "contrast", "mean"]
    assert any("scroll" in c for c in page.inside["shift-table"])
    shift_table = next(a for t, a in page.tags if t == "table" and a.get("id") == "shift-table")
    assert "sticky-first" in shift_table["class"].split()
    style = page.inline["style"]
    assert ".scroll{overflow-x:auto" in style
    assert ".sticky-first th:first-child,.sticky-first td:first-child{position:sticky;left:0" in (
        style
    )
    assert "table.lb td.num,table.lb td.text" in style and "white-space:nowrap" in style


def _rows(page: _Page, table_cells: str = "tr") -> list[dict[str, str]]:
    return [a for t, a in page.tags if t == table_cells and "data-family" in a]


def test_families_and_provenance_links_come_from_the_catalogue(results_dir):
    text, page = _page(results_dir, images=False)
    families = {a["value"] for t, a in page.tags if t == "input" and a.get("name") == "family"}
    assert families == {"norm layers", "reference"}
    first = _rows(page)[0]
    assert (first["data-method"], first["data-family"], first["data-rank"]) == (
        "norm_tent",
        "norm layers",
        "1",
    )
    links = {a["href"] for t, a in page.tags if t == "a"}
    assert "https://example.org/papers/norm-tent" in links
    commit = "0123456789abcdef0123456789abcdef01234567"
    assert f"https://github.com/example/norm-tent/tree/{commit}" in links
    assert "#m-norm-tent" in links and 'id="m-norm-tent"' in text  # name -> provenance
    # the zero-shot entry names no paper: no link, no invented one
    assert text.count('href="https://example.org/papers/norm-tent"') == 2  # summary, methods


def test_a_method_the_catalogue_does_not_describe_is_of_the_family_other(results_dir):
    record = json.loads((results_dir / "norm_tent.json").read_text())
    _write(results_dir, "norm_tent.json", {**record, "method": "undescribed"})
    _, page = _page(results_dir, images=False)
    families = {a["value"] for t, a in page.tags if t == "input" and a.get("name") == "family"}
    assert families == {"reference", report.OTHER_FAMILY}


def test_every_value_is_escaped_and_only_web_links_are_links(results_dir, monkeypatch):
    record = json.loads((results_dir / "norm_tent.json").read_text())
    _write(results_dir, "norm_tent.json", {**record, "method": "hostile"})
    hostile = {
        "description": "<script>alert(1)</script>",
        "paper": "javascript:alert(1)",
        "official_code": 'https://example.org/x" onclick="alert(1)',
        "family": "<b>family</b>",
    }
    monkeypatch.setattr(catalog, "_EXTRA", [{"methods": {"hostile": hostile}}])
    catalog.reset_catalog()
    try:
        text, page = _page(results_dir, images=False)
    finally:
        monkeypatch.undo()
        catalog.reset_catalog()
    assert "<script>alert" not in text and "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert "<b>family</b>" not in text and "&lt;b&gt;family&lt;/b&gt;" in text
    assert "javascript:" not in text
    assert not [a for t, a in page.tags if "onclick" in a]


def test_cells_sort_by_the_number_they_show():
    assert report._sort_value("73.1 ± 1.1") == "73.1"
    assert report._sort_value("+16.0 [+15.5, +16.4]") == "16.0"
    assert report._sort_value("-0.3 [-0.8, +0.2]") == "-0.3"
    assert float(report._sort_value("<0.001")) < float(report._sort_value("0.001"))
    assert report._sort_value("2,560") == "2560.0"
    assert report._sort_value("-") == report._sort_value("diverged (3 cells)") == ""


def _variant(results_dir: Path, **protocol) -> None:
    """Both runs with ``protocol`` fields changed (and only the cells it still holds)."""
    for path in results_dir.glob("*.json"):
        record = json.loads(path.read_text())
        record["protocol"] = {**record["protocol"], **protocol}
        sevs = record["protocol"]["severities"]
        record["cells"] = [c for c in record["cells"] if c["severity"] in sevs]
        path.write_text(json.dumps(record))


def _figures(results_dir: Path, baseline=report.tables.REFERENCE) -> list[str]:
    board = report.collect(results_dir, "golden")
    return [f.file for f in report.leaderboard_figures(board, baseline)]


def test_the_figures_fit_the_suite(results_dir):
    both = [report.PLOT_FOREST, report.PLOT_HEATMAP]
    assert _figures(results_dir) == [*both, report.PLOT_SEVERITY, report.PLOT_PARETO]
    assert _figures(results_dir, baseline=None) == [report.PLOT_SEVERITY, report.PLOT_PARETO]
    _variant(results_dir, severities=[5])  # one severity: no severity axis to plot
    assert _figures(results_dir) == [*both, report.PLOT_PARETO]
    _variant(results_dir, reset="continual")  # one stream: accuracy along it
    assert _figures(results_dir) == [*both, report.PLOT_STREAM, report.PLOT_PARETO]


@pytest.mark.skipif(not plots.available(), reason="matplotlib (the plots extra) not installed")
def test_figures_that_no_longer_fit_are_removed_and_nothing_else(results_dir):
    (results_dir / report.PLOT_STREAM).write_bytes(b"an old figure")
    (results_dir / "mine.png").write_bytes(b"not the leaderboard's")
    _variant(results_dir, severities=[5])
    _, written = report.write_leaderboard(results_dir, "golden")
    pngs = {p.name for p in results_dir.glob("*.png")}
    assert pngs == {report.PLOT_FOREST, report.PLOT_HEATMAP, report.PLOT_PARETO, "mine.png"}
    assert {p.name for p in written} == pngs - {"mine.png"} | {
        report.LEADERBOARD_MD,
        report.LEADERBOARD_HTML,
    }
    markdown = (results_dir / report.LEADERBOARD_MD).read_text(encoding="utf-8")
    assert f"({report.PLOT_FOREST})" in markdown and report.PLOT_SEVERITY not in markdown


# -- figures: names from results files are drawn as they are, never as mathtext ---------------
#: Broken mathtext (an unknown symbol) and valid mathtext: both must be shown literally.
DOLLARS = (r"tent$\notasymbol$", "$x^2$ cost", r"a\$b")


def _shown(fig) -> set[str]:
    """What each text of ``fig`` displays (mathtext-parsed texts are marked)."""
    from matplotlib.text import Text

    out = set()
    for t in fig.findobj(Text):
        shown, math = t._preprocess_math(t.get_text())
        out.add(f"<math>{shown}" if math else shown)
    return out


@pytest.fixture()
def drawn_figures(monkeypatch):
    """The figures the plots save during the test, in order (they are still written)."""
    drawn = []
    save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: (drawn.append(fig), save(fig, path))[1])
    return drawn


def test_dollar_signs_in_names_are_drawn_literally_in_every_plot(tmp_path, drawn_figures):
    pytest.importorskip("matplotlib")
    drawn = drawn_figures
    record = json.loads((GOLDEN / "golden_tent.json").read_text())
    shifts = record["protocol"]["shifts"]
    records, labels = [record, record, record], list(DOLLARS)
    order = [(s, 3) for s in shifts]
    rows = [(label, 1.0, -0.5, 2.5) for label in labels]
    plots.forest(rows, DOLLARS[0], tmp_path / "f.png")
    plots.delta_heatmap(labels, [*DOLLARS[1:], "mean"], [[1.0, 2.0, 3.0]] * 3, DOLLARS[1],
                        tmp_path / "h.png")  # fmt: skip
    plots.accuracy_vs_severity(records, labels, tmp_path / "s.png")
    plots.accuracy_over_stream(records, labels, order, tmp_path / "o.png", [True])
    plots.accuracy_vs_time(records, labels, tmp_path / "t.png")
    assert len(drawn) == 5
    for fig in drawn:
        shown = _shown(fig)
        assert not [s for s in shown if s.startswith("<math>")], shown
        assert set(DOLLARS) <= shown, shown


def test_a_stream_plot_shows_a_shift_name_with_dollars_literally(tmp_path, drawn_figures):
    pytest.importorskip("matplotlib")
    drawn = drawn_figures
    record = json.loads((GOLDEN / "golden_tent.json").read_text())
    name = r"$\sqrt{noise$"
    for c in record["cells"]:
        c["shift"] = name if c["shift"] == "contrast" else c["shift"]
    order = [("gaussian_noise", 3), (name, 3)]
    plots.accuracy_over_stream([record], ["tent"], order, tmp_path / "o.png")
    assert f"{name} 3" in _shown(drawn[0]) or name in _shown(drawn[0])


def test_a_leaderboard_of_runs_named_with_dollars_draws_its_figures(results_dir):
    pytest.importorskip("matplotlib")
    record = json.loads((results_dir / "norm_tent.json").read_text())
    _write(results_dir, "norm_tent.json", {**record, "method_preset": r"tent$\notasymbol$"})
    _, written = report.write_leaderboard(results_dir, "golden")
    assert {report.PLOT_FOREST, report.PLOT_HEATMAP, report.PLOT_PARETO} <= {
        p.name for p in written
    }
