"""A third-party package adds a method and a shift with nothing but its own entry points
(a ``*.dist-info/entry_points.txt`` on ``sys.path``), and ``tta-bench run`` uses them with no
change to this repository's code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from processes import on_sys_path

PLUGIN = textwrap.dedent(
    '''
    """An out-of-tree tta-bench plugin: a flip-averaging method and an inversion shift."""
    from __future__ import annotations

    import torch

    from tta_bench.method import Method


    class FlipVote(Method):
        """Average the logits of each image and its horizontal mirror image."""

        @torch.no_grad()
        def step(self, images):
            return (self.model(images) + self.model(images.flip(-1))) / 2


    def invert(images, severity, *, generator):
        """Blend towards the photographic negative; severity 5 is fully inverted."""
        alpha = severity / 5.0
        return (1 - alpha) * images + alpha * (1.0 - images)
    '''
)

CATALOGUE = textwrap.dedent(
    """
    methods:
      flip_vote: {description: Average logits over an image and its mirror image.}
    shifts:
      invert: {description: Blend towards the photographic negative.}
    suites:
      digits-invert:
        description: Digits under inversion (an out-of-tree suite).
        dataset: digits
        dataset_args: {split: test}
        shifts: [invert]
        severities: [5]
        batch_size: 64
        reset: reset_each_shift
        default_model: tiny-clip-digits
    """
)


def _install(root: Path) -> None:
    pkg = root / "flipvote_plugin"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(PLUGIN)
    (pkg / "catalog.yaml").write_text(CATALOGUE)
    (pkg / "catalog.py").write_text(
        "from pathlib import Path\nPATH = str(Path(__file__).with_name('catalog.yaml'))\n"
    )
    info = root / "flipvote_plugin-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flipvote-plugin\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text(
        "[tta_bench.methods]\nflip_vote = flipvote_plugin:FlipVote\n\n"
        "[tta_bench.shifts]\ninvert = flipvote_plugin:invert\n\n"
        "[tta_bench.catalogs]\nflipvote = flipvote_plugin.catalog:PATH\n"
    )


def test_out_of_tree_method_and_shift_run_end_to_end(tmp_path, capsys):
    """``tta-bench ls`` in a new interpreter with the package on ``PYTHONPATH`` lists the
    method; ``tta-bench run`` (in this process, the package on ``sys.path`` and the
    registries scanned again) runs it on the shift."""
    from tta_bench.cli import main

    _install(tmp_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    out = tmp_path / "r.json"
    ls = subprocess.run(
        [sys.executable, "-m", "tta_bench.cli", "ls", "methods"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "flip_vote" in ls and "flipvote-plugin" in ls
    args = ["run", "--method", "flip_vote", "--suite", "digits-invert", "--quiet"]
    with on_sys_path(tmp_path, {}):
        code = main([*args, "--output", str(out), "seeds=[0]"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "invert" in captured.out
    record = json.loads(out.read_text())
    assert record["method"] == "flip_vote"
    assert [c["shift"] for c in record["cells"]] == ["invert"]
    assert 0.0 <= record["cells"][0]["accuracy"] <= 1.0
    origins = {(p["group"], p["name"]): p["distribution"] for p in record["provenance"]["plugins"]}
    assert origins[("tta_bench.methods", "flip_vote")] == "flipvote-plugin"
    assert origins[("tta_bench.shifts", "invert")] == "flipvote-plugin"
    assert origins[("tta_bench.datasets", "digits")] == "mura-plugin"
