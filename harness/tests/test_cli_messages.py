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
