"""Package hygiene of both distributions: the declared license ships as a LICENSE file,
one version source (the pyproject, read through importlib.metadata), typed packages."""

from __future__ import annotations

import importlib.metadata as md
from pathlib import Path

import pytest
import tomllib

import mura_plugin
import tta_bench

ROOT = Path(__file__).resolve().parents[1]
DISTS = [
    ("mura-plugin", ROOT, mura_plugin),
    ("tta-bench", ROOT / "harness", tta_bench),
]


@pytest.mark.parametrize(("dist", "where", "package"), DISTS, ids=[d for d, _, _ in DISTS])
def test_license_version_and_types(dist, where, package):
    project = tomllib.loads((where / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    text = (where / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0" in text
    meta = md.metadata(dist)
    assert meta["License-Expression"] == "Apache-2.0"
    assert "LICENSE" in (meta.get_all("License-File") or [])
    assert any(c.startswith("Intended Audience") for c in meta.get_all("Classifier") or [])
    assert package.__version__ == md.version(dist) == project["version"]
    assert (Path(package.__file__).parent / "py.typed").is_file()
