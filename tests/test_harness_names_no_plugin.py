"""The harness names no plugin component (docs/design.md#layers): the defaults it needs
come from the catalogues' ``defaults:`` section and the reference method is a contract
attribute (``Method.is_reference``), so no name of this plugin's methods, models, datasets,
shifts, losses, suites, template sets or presets appears in the harness's code, comments
or docstrings."""

from __future__ import annotations

import importlib.metadata as md
import re
from pathlib import Path

import pytest

import tta_bench
from tta_bench import catalog
from tta_bench.config import presets
from tta_bench.registry import registry

HARNESS = Path(tta_bench.__file__).resolve().parent
#: Names that are also plain words or formats the harness must be free to write: "zero"
#: (a zero mean), "simple" (tabulate's table format), "parquet" (a file format that HF
#: datasets store), "grayscale" (an image mode the decoder handles), "memo" (copy.deepcopy's
#: argument), "stamp" (a time stamp). Each is still a plugin name, so it is listed here with
#: its reason.
PLAIN_WORDS = {"zero", "simple", "parquet", "grayscale", "memo", "stamp"}


def _plugin_names() -> set[str]:
    """Every component name the mura-plugin distribution registers or catalogues."""
    dist = md.distribution("mura-plugin")
    names = {
        ep.name
        for ep in dist.entry_points
        if ep.group.startswith("tta_bench.") and ep.group not in ("tta_bench.catalogs",)
    }
    names.discard("mura_plugin")  # the config package's entry point: not a component name
    import yaml

    from mura_plugin.catalog import CATALOG_PATH

    data = yaml.safe_load(Path(CATALOG_PATH).read_text(encoding="utf-8"))
    for section in ("suites", "templates", "datasets", "methods", "models"):
        names |= set(data.get(section) or {})
    names |= {p.name for p in presets().values() if p.distribution == "mura-plugin"}
    return names


def _occurrences(names: set[str]) -> list[str]:
    pattern = re.compile(
        r"(?<![\w-])("
        + "|".join(sorted(map(re.escape, names), key=len, reverse=True))
        + r")(?![\w-])"
    )
    hits = []
    for path in sorted(HARNESS.rglob("*.py")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for m in pattern.finditer(line):
                hits.append(
                    f"{path.relative_to(HARNESS)}:{number}: {m.group(1)!r} in {line.strip()}"
                )
    return hits


def test_the_plugin_names_are_known():
    names = _plugin_names()
    # the names the harness used to hard-code, and a few of each kind
    assert {"zeroshot", "digits-c", "tiny-clip-digits", "mura", "tent-digits"} <= names
    assert {"entropy", "gaussian_noise", "digits", "openclip"} <= names


def test_no_plugin_name_in_the_harness_code():
    names = _plugin_names() - PLAIN_WORDS
    assert not _occurrences(names), "\n".join(_occurrences(names))


def test_the_scan_finds_a_name(tmp_path, monkeypatch):
    """The check can fail: a harness module that names a plugin method is caught."""
    fake = tmp_path / "tta_bench"
    fake.mkdir()
    (fake / "loop.py").write_text('if spec.method == "zeroshot":\n    pass\n', encoding="utf-8")
    monkeypatch.setattr(__import__(__name__), "HARNESS", fake)
    assert _occurrences({"zeroshot"}) == [
        "loop.py:1: 'zeroshot' in if spec.method == \"zeroshot\":"
    ]


def test_the_defaults_come_from_the_catalogue():
    assert catalog.default("method") in registry("methods").names()
    assert catalog.default("suite") in catalog.catalog()["suites"]
    assert catalog.default("model") in registry("models").names()
    reference = catalog.default("reference")
    assert registry("methods").get(reference).is_reference


@pytest.mark.parametrize("name", registry("methods").names())
def test_only_the_reference_method_is_the_reference(name):
    assert registry("methods").get(name).is_reference == (name == catalog.default("reference"))
