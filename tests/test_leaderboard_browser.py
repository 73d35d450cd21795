"""The leaderboard page in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``, driven by Selenium) opens the committed
``results/digits-c/leaderboard.html`` from the file system in a 1280 x 900 window and
checks that it renders without console errors (every figure loads), that clicking a
column's header sorts the rows by it, that filtering by family or name hides rows, that the
summary table fits the window with no number wrapped while the per-shift table scrolls in
its own box with the method column fixed, and saves a screenshot whose layout it checks.

Skipped, saying why, only where Chromium, its driver or Selenium is missing;
``TTA_BENCH_REQUIRE_BROWSER=1`` (CI) makes that a failure instead."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "results" / "digits-c" / "leaderboard.html"
WIDTH, HEIGHT = 1280, 900
ARGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage")


#: The runs the committed page ranks: every results file of results/digits-c.
RANKED = sum(
    not p.name.endswith(".realtime.json")
    for p in (Path(__file__).resolve().parents[1] / "results" / "digits-c").glob("*.json")
)


def _which(*names: str) -> str | None:
    return next((p for p in map(shutil.which, names) if p), None)


@pytest.fixture(scope="module")
def browser():
    chromium = os.environ.get("CHROMIUM") or _which("chromium", "chromium-browser")
    driver_path = os.environ.get("CHROMEDRIVER") or _which("chromedriver")
    missing = [] if chromium else ["chromium"]
    missing += [] if driver_path else ["chromedriver"]
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing.append("selenium (pip install 'tta-bench[test]')")
    if missing:
        reason = (
            f"no headless browser: {', '.join(missing)} not found "
            "(apt-get install chromium chromium-driver)"
        )
        if os.environ.get("TTA_BENCH_REQUIRE_BROWSER") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in (*ARGS, f"--window-size={WIDTH},{HEIGHT}", "--hide-scrollbars"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(driver_path))
    driver.execute_cdp_cmd(  # the viewport exactly WIDTH x HEIGHT CSS pixels, at scale 1
        "Emulation.setDeviceMetricsOverride",
        {"width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False},
    )
    yield driver
    driver.quit()


@pytest.fixture()
def page(browser):
    """The page freshly opened from the file system, the console read empty before."""
    browser.get_log("browser")
    browser.get(PAGE.as_uri())
    return browser


def _rows(driver, table: str = "summary-table") -> list[dict]:
    return driver.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0] + ' tbody tr')).map("
        "tr => ({method: tr.dataset.method, family: tr.dataset.family, shown: !tr.hidden, "
        "drawn: tr.getClientRects().length > 0, "
        "values: Array.from(tr.cells).map(td => td.dataset.v)}))",
        f"#{table}",
    )


def _click_header(driver, label: str, table: str = "summary-table") -> int:
    """Click the sort button of the column headed ``label``; its column index."""
    from selenium.webdriver.common.by import By

    heads = driver.find_elements(By.CSS_SELECTOR, f"#{table} thead th")
    index = next(i for i, th in enumerate(heads) if th.text.strip(" ▲▼") == label)
    heads[index].find_element(By.TAG_NAME, "button").click()
    return index


def test_the_page_renders_without_console_errors(page):
    severe = [e for e in page.get_log("browser") if e["level"] == "SEVERE"]
    assert not severe, severe
    images = page.execute_script(
        "return Array.from(document.images).map(i => [i.getAttribute('src'), "
        "i.complete && i.naturalWidth > 0])"
    )
    assert images and all(ok for _, ok in images), images
    assert len(_rows(page)) == RANKED
    # the check can fail: an error the page logs is read back
    page.execute_script("console.error('probe: an error the test must see')")
    assert any("probe" in e["message"] for e in page.get_log("browser"))


def test_clicking_a_header_sorts_the_rows_by_that_column(page):
    before = [r["method"] for r in _rows(page)]
    col = _click_header(page, "ms/sample")
    rows = _rows(page)
    times = [float(r["values"][col]) for r in rows]
    assert times == sorted(times) and [r["method"] for r in rows] != before
    _click_header(page, "ms/sample")  # again: descending
    assert [float(r["values"][col]) for r in _rows(page)] == sorted(times, reverse=True)
    _click_header(page, "method")
    names = [r["method"] for r in _rows(page)]
    assert names == sorted(names)
    _click_header(page, "rank")  # back to the ranking
    assert [r["method"] for r in _rows(page)] == before


def test_filtering_by_family_and_name_hides_rows(page):
    from selenium.webdriver.common.by import By

    families = {r["family"] for r in _rows(page)}
    assert {"reference", "TENT family", "CLIP batch", "episodic", "online"} <= families
    box = page.find_element(By.CSS_SELECTOR, "#filters input[name=family][value='TENT family']")
    box.click()
    for table in ("summary-table", "shift-table", "cost-table"):
        rows = _rows(page, table)
        hidden = [r for r in rows if not r["shown"]]
        assert hidden and all(r["family"] == "TENT family" for r in hidden), table
        assert all(r["shown"] for r in rows if r["family"] != "TENT family"), table
        if table != "cost-table":  # (the cost details are folded: no row is drawn)
            assert [r["drawn"] for r in rows] == [r["shown"] for r in rows], table
    cards = page.execute_script(  # the methods' provenance entries follow the filter too
        "return Array.from(document.querySelectorAll('#methods li')).map("
        "li => [li.dataset.family, li.getClientRects().length > 0])"
    )
    assert cards and all(drawn == (family != "TENT family") for family, drawn in cards)
    shown = sum(r["shown"] for r in _rows(page))
    assert page.find_element(By.ID, "shown").text == f"{shown} of {RANKED} runs"
    box.click()
    page.find_element(By.ID, "search").send_keys("mura")
    shown_mura = sorted(r["method"] for r in _rows(page) if r["shown"])
    assert shown_mura == ["mura", "mura-online", "mura-online-text", "mura-seed"]


def test_the_summary_fits_the_window_and_no_number_wraps(page, tmp_path):
    from PIL import Image

    layout = page.execute_script(
        "const t = document.getElementById('summary-table');"
        "const box = document.getElementById('shift-table').parentElement;"
        "const spans = Array.from(t.querySelectorAll('td.num span.v'));"
        "return {inner: window.innerWidth, page: document.documentElement.scrollWidth,"
        " right: t.getBoundingClientRect().right, scroll: t.scrollWidth,"
        " top: t.getBoundingClientRect().top, bottom: t.getBoundingClientRect().bottom,"
        " wrapped: spans.filter(s => s.getClientRects().length > 1).map(s => s.textContent),"
        " numbers: spans.length, box: box.clientWidth, boxScroll: box.scrollWidth}"
    )
    assert layout["inner"] == WIDTH
    assert layout["right"] <= WIDTH and layout["scroll"] <= WIDTH, layout
    assert layout["page"] <= WIDTH, "the page scrolls sideways"
    assert layout["numbers"] > 100 and not layout["wrapped"], layout["wrapped"]
    # and none would: a number squeezed to 1 px wide stays on one line, as it would not
    # without the page's nowrap
    squeezed, free = page.execute_script(
        "const span = document.querySelector('#summary-table td.num:nth-child(4) span.v');"
        "const lines = document.createRange(); lines.selectNodeContents(span);"
        "span.style.display = 'inline-block'; span.style.width = '1px';"
        "const a = lines.getClientRects().length;"
        "span.style.whiteSpace = 'normal'; const b = lines.getClientRects().length;"
        "span.removeAttribute('style'); return [a, b];"
    )
    assert (squeezed, free) == (1, 3)  # "73.1 ± 1.1": three words
    # the per-shift table is wider than the window: it scrolls in its own box, and its
    # method column stays where it is
    assert layout["boxScroll"] > layout["box"]
    moved = page.execute_script(
        "const box = document.getElementById('shift-table').parentElement;"
        "const [name, first] = document.querySelector('#shift-table tbody tr').cells;"
        "const a = [name.getBoundingClientRect().left, first.getBoundingClientRect().left];"
        "box.scrollLeft = 300;"
        "const b = [name.getBoundingClientRect().left, first.getBoundingClientRect().left];"
        "box.scrollLeft = 0; return [a, b];"
    )
    (name_before, first_before), (name_after, first_after) = moved
    assert name_after == name_before and first_after == pytest.approx(first_before - 300)
    shot = tmp_path / "leaderboard.png"
    assert page.save_screenshot(str(shot))
    image = Image.open(shot).convert("RGB")
    assert image.size == (WIDTH, HEIGHT)
    # right of the summary table, down its rows, the window is blank: nothing cut off
    top, bottom = int(layout["top"]) + 1, min(int(layout["bottom"]), HEIGHT) - 1
    strip = image.crop((int(layout["right"]) + 2, top, WIDTH, bottom))
    assert strip.getextrema() == ((255, 255), (255, 255), (255, 255))
    if os.environ.get("TTA_BENCH_SCREENSHOT"):  # keep it (docs/img/leaderboard.png)
        shutil.copy(shot, os.environ["TTA_BENCH_SCREENSHOT"])
