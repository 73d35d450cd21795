"""The leaderboard's tracks (``tta_bench.report.tracks``) on small synthetic results built from
the golden runs in ``harness/tests/golden/``: a ranked run's realtime twin (the same run on
the compute-matched track, in the same folder) fills its ``realtime acc %`` and
``adapted %`` columns and is never ranked, rows without one show ``-``, a board of the
realtime track alone is an ordinary board; runs of many stream orders show the central 95%
of the orders and the Expected Tail Accuracy (checked against a hand computation); the
page and the forest plot compare per sample where the markdown does; the accuracy-vs-cost
figure draws the Pareto front and the realtime markers; and the page shows what the
markdown shows."""

from __future__ import annotations

import copy
import json
import re
import shutil
import statistics
from pathlib import Path
from typing import Any

import pytest

from tta_bench.report import collect, figures, plots, stats, tracks
from tta_bench.report import leaderboard as report
from tta_bench.report.per_sample import SampleAnalysis

from .helpers import GOLDEN
from .test_report_html import _Page

MAIN_ID = "golden@v1-reset_each_shift-bs8-0123456789"
RT_ID = "golden@v1-reset_each_shift-bs8-rt-abcdef0123"
ORDERS_ID = "golden@v1-reset_each_shift-bs8-o20-1111111111"


def _golden(name: str) -> dict[str, Any]:
    return json.loads((GOLDEN / name).read_text(encoding="utf-8"))


def _write(d: Path, name: str, record: dict[str, Any]) -> Path:
    path = d / name
    path.write_text(json.dumps(record), encoding="utf-8")
    return path


def _score(cell: dict[str, Any], accuracy: float) -> dict[str, Any]:
    """``cell`` scoring ``accuracy`` (and the error that goes with it)."""
    cell.update(accuracy=round(accuracy, 6), error=round(1 - accuracy, 6))
    return cell


def _realtime(record: dict[str, Any], drop: float = 0.05) -> dict[str, Any]:
    """``record`` on the realtime track: every accuracy ``drop`` lower; of each cell's 100
    samples 20 adapted on at severity 3 and 40 at severity 5 (30% over all cells)."""
    twin = copy.deepcopy(record)
    twin["protocol"] = {**record["protocol"], "id": RT_ID, "realtime": True}
    for c in twin["cells"]:
        _score(c, c["accuracy"] - drop)
        c["realtime"] = {"adapted_samples": 20 if c["severity"] == 3 else 40, "samples": c["n"]}
    return twin


@pytest.fixture()
def results_dir(tmp_path):
    """The golden zero-shot and tent runs, and tent's realtime twin beside them."""
    d = tmp_path / "results"
    d.mkdir()
    for name in ("golden_zeroshot.json", "golden_tent.json"):
        shutil.copy(GOLDEN / name, d / name)
    _write(d, "golden_tent_rt.json", _realtime(_golden("golden_tent.json")))
    return d


def _column(headers: list[str], rows: list[list[Any]], name: str) -> list[Any]:
    return [row[headers.index(name)] for row in rows]


def _summary(page: _Page, text: str) -> dict[str, list[str]]:
    """The page's summary table: each header's column of cell texts."""
    body = text.split('<table id="summary-table"', 1)[1].split("</table>", 1)[0]
    rows = [re.findall(r'<span class="v">(.*?)</span>', tr) for tr in body.split("<tr ")[1:]]
    head = page.headers["summary-table"][3:-1]  # rank, method, family ... links
    return {h: [r[i] for r in rows] for i, h in enumerate(head)}


# -- realtime twins ----------------------------------------------------------------------
def test_a_realtime_twin_fills_its_runs_columns_and_is_never_ranked(results_dir):
    board = report.collect(results_dir, "golden")
    assert board.protocol_id == MAIN_ID
    assert [e.path.name for e in board.entries] == ["golden_tent.json", "golden_zeroshot.json"]
    assert board.left_out == []  # the twin is no noise
    assert [t.path.name if t else None for t in board.twins()] == ["golden_tent_rt.json", None]
    headers, rows = report.leaderboard_rows(board)
    assert headers[headers.index("p") + 1 :][:2] == ["realtime acc %", "adapted %"]
    # tent's per-seed means 46.5, 49.0, 51.0, on the realtime track 5 points lower: 41.5,
    # 44.0, 46.0; mean 43.83, sd 2.255, t(0.975, 2) = 4.303: 43.8 ± 5.6
    assert _column(headers, rows, "realtime acc %") == ["43.8 ± 5.6", "-"]
    assert _column(headers, rows, "adapted %") == ["30.0", "-"]  # (6 x 20 + 6 x 40) / 1200
    assert _column(headers, rows, "accuracy % (95% CI)") == ["48.8 ± 5.6", "45.0 ± 0.0"]
    per_seed = [0.415, 0.44, 0.46]
    est = stats.describe(per_seed)
    assert f"{100 * est.mean:.1f} ± {100 * est.half_width:.1f}" == "43.8 ± 5.6"


def test_the_markdown_and_the_page_explain_and_show_the_realtime_columns(results_dir):
    board = report.collect(results_dir, "golden")
    text = report.leaderboard_markdown(board, images=False)
    note = next(line for line in text.splitlines() if line.startswith("Realtime acc %"))
    for words in ("`realtime: true`", "Alfarra et al., ICML 2024", "one batch per unit",
                  "backward pass counting two forwards", "adapts on one batch in k",
                  "never ranked", "Adapted %"):  # fmt: skip
        assert words in note, note
    assert text.index(note) < text.index("| rank")  # above the table
    assert "golden_tent.json (realtime: golden_tent_rt.json)" in text  # provenance
    assert "## Left out" not in text
    html = report.leaderboard_html(board, images=False)
    page = _Page(html)
    shown = _summary(page, html)
    headers, rows = report.leaderboard_rows(board)
    for name in ("realtime acc %", "adapted %", "accuracy % (95% CI)"):
        assert shown[name] == _column(headers, rows, name)
    assert "Alfarra et al., ICML 2024" in html and "<code>realtime: true</code>" in html


def test_twins_that_are_not_used_are_left_out_as_the_realtime_track_of_their_run(results_dir):
    tent = _golden("golden_tent.json")
    partial = _realtime(tent)
    partial["cells"] = partial["cells"][:5]
    _write(results_dir, "a_partial_rt.json", partial)
    other = _realtime({**tent, "method_config": {"lr": 0.5}, "method_config_hash": "other"})
    _write(results_dir, "other_config_rt.json", other)
    _write(results_dir, "z_again_rt.json", _realtime(tent, drop=0.06))
    board = report.collect(results_dir, "golden")
    reasons = dict(board.left_out)
    assert reasons["a_partial_rt.json"] == "realtime track of tent: incomplete: 5 of 12 cells"
    assert reasons["golden_tent_rt.json"] == (
        "realtime track of tent: superseded by z_again_rt.json"
    )
    assert reasons["other_config_rt.json"].startswith(f"protocol {RT_ID} differs")
    assert reasons["other_config_rt.json"].endswith("realtime track of a run not ranked here")
    assert board.twins()[0].path.name == "z_again_rt.json"
    assert [e.path.name for e in board.entries] == ["golden_tent.json", "golden_zeroshot.json"]


def test_other_weights_are_no_twin_and_realtime_files_never_choose_the_protocol(results_dir):
    tent = _golden("golden_tent.json")
    moved = _realtime(tent)
    moved["model"] = {**moved["model"], "state_sha256": "0" * 64}
    _write(results_dir, "golden_tent_rt.json", moved)
    zeroshot = _realtime(_golden("golden_zeroshot.json"))
    _write(results_dir, "zs_rt.json", zeroshot)
    lr = {**tent, "method_config": {"lr": 1}, "method_config_hash": "lr1"}
    _write(results_dir, "tent_lr_rt.json", _realtime(lr))
    board = report.collect(results_dir, "golden")  # 3 realtime files, 2 of the protocol
    assert board.protocol_id == MAIN_ID
    assert [t.path.name if t else None for t in board.twins()] == [None, "zs_rt.json"]
    assert "golden_tent_rt.json" in dict(board.left_out)


def test_a_twin_with_a_field_added_since_matches_by_the_config_hash(results_dir):
    """A method field added after the ranked run is out of the config hash at its default:
    a later realtime run of the same config is its twin although its config lists more."""
    tent = _golden("golden_tent.json")
    later = _realtime(tent)
    later["method_config"] = {**tent["method_config"], "added_later": 256.0}
    _write(results_dir, "golden_tent_rt.json", later)
    assert [t.path.name if t else None for t in report.collect(results_dir, "golden").twins()][
        0
    ] == "golden_tent_rt.json"


def test_a_board_of_the_realtime_track_alone_is_an_ordinary_board(results_dir):
    board = report.collect(results_dir, "golden", RT_ID)
    assert [e.path.name for e in board.entries] == ["golden_tent_rt.json"]
    assert board.twins() == [None]
    reasons = dict(board.left_out)
    assert reasons["golden_tent.json"] == f"protocol {MAIN_ID} differs from the ranked {RT_ID}"
    headers, rows = report.leaderboard_rows(board)
    assert not set(tracks.REALTIME_COLUMNS) & set(headers)
    assert _column(headers, rows, "accuracy % (95% CI)") == ["43.8 ± 5.6"]
    text = report.leaderboard_markdown(board, images=False)
    assert "Realtime acc %" not in text and "# Leaderboard: golden" in text
    assert "<td" in report.leaderboard_html(board, images=False)


# -- many stream orders ------------------------------------------------------------------
#: Per-order accuracies of the orders run (20 orders), each the mean of its two cells.
ORDER_MEANS = [0.70, 0.72, 0.56, 0.71, 0.69, 0.73, 0.68, 0.74, 0.70, 0.71,
               0.60, 0.72, 0.69, 0.70, 0.71, 0.73, 0.68, 0.72, 0.70, 0.78]  # fmt: skip


def _orders(record: dict[str, Any], means: list[float]) -> dict[str, Any]:
    """``record`` under a protocol of ``len(means)`` stream orders at severity 3: order
    ``s`` scores ``means[s]`` (``+-0.05`` on the two shifts)."""
    out = copy.deepcopy(record)
    n = len(means)
    out["protocol"] = {**record["protocol"], "id": ORDERS_ID, "orders": n, "severities": [3]}
    out["seeds"] = list(range(n))
    template = record["cells"][0]
    out["cells"] = [
        _score({**template, "shift": shift, "severity": 3, "seed": s, "reference_accuracy": 0.5},
               m + sign * 0.05)
        for s, m in enumerate(means)
        for shift, sign in (("gaussian_noise", 1), ("contrast", -1))
    ]  # fmt: skip
    return out


@pytest.fixture()
def orders_dir(tmp_path):
    d = tmp_path / "orders"
    d.mkdir()
    _write(d, "tent.json", _orders(_golden("golden_tent.json"), ORDER_MEANS))
    _write(d, "zs.json", _orders(_golden("golden_zeroshot.json"), [0.5] * 20))
    return d


def test_orders_show_their_spread_and_the_expected_tail_accuracy(orders_dir):
    board = report.collect(orders_dir, "golden")
    headers, rows = report.leaderboard_rows(board)
    acc = headers.index("accuracy % (95% CI over orders)")
    assert headers[acc + 1 : acc + 4] == ["orders", "central 95% of orders", "ETA %"]
    assert "accuracy % (95% CI)" not in headers
    assert rows[0][1] == "tent" and rows[0][acc + 1] == "20"
    # sorted: 0.56, 0.60, 0.68, ..., 0.74, 0.78. The 2.5th percentile lies at 19 x 0.025 =
    # 0.475 between the first two: 0.56 + 0.475 x 0.04 = 0.579; the 97.5th at 18.525:
    # 0.74 + 0.525 x 0.04 = 0.761. ETA: the worst ceil(10% x 20) = 2 orders, (0.56 + 0.60) / 2
    assert rows[0][acc + 2 : acc + 4] == ["57.9 to 76.1", "58.0"]
    assert rows[1][acc + 2 : acc + 4] == ["50.0 to 50.0", "50.0"]
    mean = 100 * statistics.fmean(ORDER_MEANS)
    assert rows[0][acc].startswith(f"{mean:.1f} ± ")
    spread = stats.order_spread(board.entries[0].record)
    assert spread.tail_n == 2 and spread.tail == pytest.approx(0.58)


def test_orders_are_explained_above_the_table_and_shown_on_the_page(orders_dir):
    board = report.collect(orders_dir, "golden")
    text = report.leaderboard_markdown(board, images=False)
    assert "over the orders." in text and "per seed the mean" not in text
    note = next(line for line in text.splitlines() if line.startswith("Orders (`orders: 20`)"))
    assert "worst 10% of orders (2 of 20)" in note and "Expected Tail Accuracy" in note
    assert text.index(note) < text.index("| rank")
    html = report.leaderboard_html(board, images=False)
    shown = _summary(_Page(html), html)
    headers, rows = report.leaderboard_rows(board)
    for name in ("accuracy % (95% CI over orders)", *tracks.ORDERS_COLUMNS):
        assert shown[name] == _column(headers, rows, name)


# -- per-sample comparisons on the page and in the forest plot ---------------------------
def _with_sample_analysis(board: collect.Leaderboard) -> SampleAnalysis:
    """A per-sample analysis of the golden board (tent +2.0 [+0.5, +3.5], McNemar p 0.01),
    put where ``collect.sample_analysis`` finds it, as if every run had per-sample files."""
    cmp = stats.PairedComparison("tent", "zeroshot", "accuracy", "batch", "block bootstrap",
                                 1200, 0.02, 0.005, 0.035, 0.01)  # fmt: skip
    analysis = SampleAnalysis([cmp, None], [0.01, None], [1, 2], 1200, 3, 0.1, 0.02, None)
    board.analyses[report.tables.baseline_name(report.tables.REFERENCE)] = analysis
    return analysis


def test_the_page_compares_per_sample_where_the_markdown_does(results_dir):
    board = report.collect(results_dir, "golden")
    _with_sample_analysis(board)
    headers, rows = report.leaderboard_rows(board)
    html = report.leaderboard_html(board, images=False)
    page = _Page(html)
    shown = _summary(page, html)
    for name in ("Δ vs zeroshot (95% CI)", "p", "q (BH)", "tier"):
        assert shown[name] == _column(headers, rows, name)
    assert shown["Δ vs zeroshot (95% CI)"][0] == "+2.0 [+0.5, +3.5]"
    assert '<td class="num better"' in html  # the interval lies above zero
    assert 'title="difference to the baseline over the same samples, 95% block' in html
    markdown = report.leaderboard_markdown(board, images=False)
    for note in collect._notes(board, report.tables.REFERENCE, "t", per_sample=True):
        assert note.split("`")[0][:60] in markdown
    assert "block bootstrap over stream batches" in html and "Benjamini-Hochberg" in html


def test_the_forest_plot_draws_the_per_sample_intervals(results_dir, monkeypatch, tmp_path):
    board = report.collect(results_dir, "golden")
    _with_sample_analysis(board)
    forest = report.leaderboard_figures(board)[0]
    assert forest.file == report.PLOT_FOREST and "block bootstrap" in forest.caption
    drawn = []
    monkeypatch.setattr(plots, "forest", lambda rows, base, path: drawn.append(rows) or path)
    analysis = figures._analyse(board, report.tables.REFERENCE, "t")
    figures._draw(board, analysis, tmp_path, [forest])
    ((row,),) = drawn
    assert row[0] == "tent" and row[1:] == pytest.approx((2.0, 0.5, 3.5))
    bare = report.collect(results_dir, "golden")  # no per-sample files: as before
    assert "on the same seeds and cells" in report.leaderboard_figures(bare)[0].caption


# -- the accuracy-vs-cost figure ---------------------------------------------------------
def _timed(record: dict[str, Any], method: str, ms: float, acc: float) -> dict[str, Any]:
    out = copy.deepcopy(record)
    out["method"] = method
    for i, c in enumerate(out["cells"]):
        c["time_per_sample_s"] = ms / 1e3
        _score(c, acc + (0.01 if i % 2 else -0.01))
    return out


@pytest.fixture()
def cost_dir(tmp_path):
    """Four runs: fast (0.5 ms, 45%), middle (1 ms, 52%), best (2 ms, 60%) and dominated
    (2.5 ms, 50%: middle is both faster and more accurate); best has a realtime twin."""
    d = tmp_path / "cost"
    d.mkdir()
    tent = _golden("golden_tent.json")
    for name, ms, acc in (("fast", 0.5, 0.45), ("middle", 1.0, 0.52), ("best", 2.0, 0.6),
                          ("dominated", 2.5, 0.5)):  # fmt: skip
        _write(d, f"{name}.json", _timed(tent, name, ms, acc))
    _write(d, "best_rt.json", _realtime(_timed(tent, "best", 2.0, 0.6), drop=0.1))
    return d


@pytest.fixture()
def drawn(monkeypatch):
    """The figures the plots save during the test, in order (they are still written)."""
    out = []
    save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: (out.append(fig), save(fig, path))[1])
    return out


def test_the_pareto_front_and_the_realtime_markers(cost_dir, drawn):
    pytest.importorskip("matplotlib")
    board = report.collect(cost_dir, "golden")
    records = [e.record for e in board.entries]
    points = plots.time_accuracy_points(records)
    front = plots.pareto_front([(x, y) for _, x, y, _ in points])
    assert {board.entries[points[i][0]].label for i in front} == {"fast", "middle", "best"}
    pareto = next(f for f in report.leaderboard_figures(board) if f.file == report.PLOT_PARETO)
    assert "Hollow triangles" in pareto.caption
    analysis = figures._analyse(board, report.tables.REFERENCE, "t")
    figures._draw(board, analysis, cost_dir, [pareto])
    (ax,) = drawn[0].axes
    lines = {line.get_label(): line for line in ax.get_lines()}
    step = lines["Pareto front"]
    assert list(step.get_xdata()) == pytest.approx([0.5, 1.0, 2.0])
    assert list(step.get_ydata()) == pytest.approx([45.0, 52.0, 60.0])
    markers = [ln for ln in ax.get_lines() if ln.get_marker() == "v" and len(ln.get_xdata())]
    ((x, y),) = [(m.get_xdata()[0], m.get_ydata()[0]) for m in markers]
    assert (x, y) == pytest.approx((2.0, 50.0))  # best, 10 points lower, at its time
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["Pareto front", plots.REALTIME_LEGEND]


def test_without_twins_the_figure_is_drawn_as_before(cost_dir, tmp_path):
    pytest.importorskip("matplotlib")
    (cost_dir / "best_rt.json").unlink()
    board = report.collect(cost_dir, "golden")
    records, labels = [e.record for e in board.entries], [e.label for e in board.entries]
    plain = plots.accuracy_vs_time(records, labels, tmp_path / "a.png").read_bytes()
    nones = plots.accuracy_vs_time(records, labels, tmp_path / "b.png", [None] * 4)
    assert nones.read_bytes() == plain


def test_the_page_shows_the_markdowns_figures_and_regenerates_identically(cost_dir):
    pytest.importorskip("matplotlib")
    _, written = report.write_leaderboard(cost_dir, "golden")
    first = {p.name: p.read_bytes() for p in written}
    markdown = first[report.LEADERBOARD_MD].decode()
    html = first[report.LEADERBOARD_HTML].decode()
    in_markdown = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", markdown)
    images = [a["src"] for t, a in _Page(html).tags if t == "img"]
    assert images == in_markdown and report.PLOT_PARETO in images
    assert set(images) == {p.name for p in written if p.suffix == ".png"}
    report.write_leaderboard(cost_dir, "golden")
    assert {p.name: p.read_bytes() for p in written} == first
