"""The CLI's messages go through logging (-v more, -q errors only), every command's help
shows an example, and ``tta-bench --version`` / ``python -m tta_bench`` work."""

from __future__ import annotations

import subprocess
import sys

import pytest

import tta_bench
from tta_bench.cli import build_parser

from .helpers import cli, subprocess_env


def test_warnings_are_shown_by_default_and_silenced_by_q(capsys, tmp_path):
    args = ("run", "--quiet", "--data-dir", str(tmp_path), "--cfg", "seeds=[0]")
    rc, _, err = cli(capsys, *args)
    assert rc == 0 and "tta-bench: warning: --data-dir" in err
    rc, _, err = cli(capsys, *args, "-q")
    assert rc == 0 and "--data-dir" not in err
    rc, _, err = cli(capsys, "run", "--quiet", "--cfg", "seeds=[0]", "-q", "method=norm_tnet")
    assert rc == 2 and "unknown method 'norm_tnet'" in err  # errors still shown


def test_every_command_has_an_example_in_its_help():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    missing = [name for name, p in sub.choices.items() if "example" not in (p.epilog or "")]
    assert not missing


@pytest.mark.parametrize("module", [["-m", "tta_bench"], ["-m", "tta_bench.cli"]])
def test_version_from_the_console_and_python_m(module):
    done = subprocess.run(
        [sys.executable, *module, "--version"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=60,
    )
    assert done.returncode == 0
    assert done.stdout.strip() == f"tta-bench {tta_bench.__version__}"


@pytest.mark.parametrize("under", [False, True], ids=["file", "under-a-file"])
def test_env_says_what_is_wrong_with_a_cache_path_that_is_a_file(
    capsys, tmp_path, monkeypatch, under
):
    import json

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder", encoding="utf-8")
    path = blocker / "cache" if under else blocker
    monkeypatch.setenv("TTA_BENCH_CACHE", str(path))
    problem = (
        f"{path} (not usable: {blocker} is a file, not a folder; set TTA_BENCH_CACHE to a "
        "writable folder)"
    )
    rc, out, err = cli(capsys, "env", "--json")
    assert (rc, err) == (0, "")
    doc = json.loads(out)  # valid JSON all the same
    assert doc["cache dir"] == problem
    assert doc["decoded cache"] == doc["text-head cache"] == "unknown (no usable cache dir)"
    assert "plugin distributions" in doc
    rc, out, err = cli(capsys, "env")
    assert (rc, err) == (0, "") and problem in out
