"""``--include FILE_OR_DIR``: local Python files (a ``TTA_BENCH`` declaration) and YAML
catalogues go through the same registries and checks as entry points; results record each
file with its hash; a clash with an installed name and a bad file are errors naming them."""

from __future__ import annotations

import hashlib
import json
import signal
import textwrap
from pathlib import Path

import pytest

from tta_bench.registry import registry

from .helpers import cli

METHOD = '''\
"""A local method: the frozen classifier with its logits scaled."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tta_bench.method import Method


@dataclass
class ScaledConfig:
    scale: float = 2.0


class Scaled(Method):
    Config = ScaledConfig

    @torch.no_grad()
    def step(self, images: torch.Tensor) -> torch.Tensor:
        return self.config.scale * self.model(images).float()


def top2(logits: torch.Tensor, labels: torch.Tensor) -> float:
    hit = (logits.topk(2, dim=1).indices == labels[:, None]).any(dim=1)
    return float(hit.float().mean())


TTA_BENCH = {"methods": {"my-local": Scaled}, "metrics": {"top2": top2}}
'''

CATALOGUE = """\
methods:
  my-local: {description: The frozen classifier with its logits scaled.}
suites:
  my-local-suite:
    description: The synthetic test split dimmed at severity 2.
    dataset: synthetic
    dataset_args: {split: test}
    shifts: [dim]
    severities: [2]
    batch_size: 8
    reset: reset_each_shift
    default_model: tiny-clip
"""


@pytest.fixture()
def local(tmp_path: Path) -> Path:
    """A directory with a local method (and metric) and a catalogue with a suite."""
    folder = tmp_path / "local"
    folder.mkdir()
    (folder / "my_method.py").write_text(METHOD, encoding="utf-8")
    (folder / "suites.yaml").write_text(CATALOGUE, encoding="utf-8")
    (folder / "_helper.py").write_text("raise RuntimeError('never imported')\n")
    (folder / "notes.txt").write_text("not a component\n")
    return folder


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_local_method_and_suite_run_end_to_end(capsys, local, tmp_path):
    out = tmp_path / "r.json"
    rc, stdout, err = cli(
        capsys,
        "run",
        "--include",
        str(local),
        "--method",
        "my-local",
        "--suite",
        "my-local-suite",
        "seeds=[0]",
        "method.scale=3.0",
        "--output",
        str(out),
        "--quiet",
    )
    assert rc == 0, err
    assert "my-local on my-local-suite" in stdout
    record = json.loads(out.read_text())
    assert record["method"] == "my-local" and record["method_config"] == {"scale": 3.0}
    assert [(c["shift"], c["severity"]) for c in record["cells"]] == [("dim", 2)]
    assert "top2" in record["cells"][0]  # the local metric is computed for every cell
    method_file = (local / "my_method.py").resolve()
    origin = next(p for p in record["provenance"]["plugins"] if p["name"] == "my-local")
    assert origin == {
        "group": "tta_bench.methods",
        "name": "my-local",
        "object": f"{method_file}:Scaled",
        "distribution": f"local:{method_file}",
        "version": _sha(method_file)[:12],
    }
    includes = record["provenance"]["includes"]
    assert includes == [
        {"path": str(method_file), "sha256": _sha(method_file), "kind": "python"},
        {
            "path": str((local / "suites.yaml").resolve()),
            "sha256": _sha(local / "suites.yaml"),
            "kind": "yaml",
        },
    ]
    # the include holds for that command only
    assert "my-local" not in registry("methods").names()


def test_an_included_method_is_listed_without_importing_it(capsys, local):
    rc, out, _ = cli(capsys, "ls", "methods", "--include", str(local / "my_method.py"))
    assert rc == 0
    row = next(line for line in out.splitlines() if line.startswith("my-local"))
    assert f"local:{(local / 'my_method.py').resolve()}" in row
    from tta_bench import include

    path = (local / "my_method.py").resolve()
    assert not [key for key in include._MODULES if key[0] == path]  # read, not imported
    rc, out, _ = cli(capsys, "ls", "suites", "--include", str(local))
    assert rc == 0 and "my-local-suite" in out


def test_validate_takes_include(capsys, local):
    rc, out, _ = cli(capsys, "validate", "method", "my-local", "--include", str(local))
    assert rc == 0, out
    assert f"from local:{(local / 'my_method.py').resolve()} " in out.splitlines()[0]


def test_a_clash_with_an_installed_name_is_an_error_naming_both(capsys, tmp_path):
    clash = tmp_path / "clash.py"
    clash.write_text(
        textwrap.dedent(
            """
            from tta_bench.method import Method

            class Mine(Method):
                def step(self, images):
                    return self.model(images)

            TTA_BENCH = {"methods": {"zeroshot": Mine}}
            """
        )
    )
    rc, _, err = cli(capsys, "ls", "methods", "--include", str(clash))
    assert rc == 2
    assert "duplicate method name 'zeroshot'" in err
    assert "tta_bench_testplugin.methods:ZeroShot (from tta-bench-testplugin 0.1)" in err
    assert f"{clash}:Mine (from local:{clash} {_sha(clash)[:12]})" in err


def test_a_catalogue_clash_names_both_origins(capsys, tmp_path):
    clash = tmp_path / "clash.yaml"
    clash.write_text("suites:\n  tiny-shifts: {dataset: synthetic, shifts: [dim]}\n")
    rc, _, err = cli(capsys, "ls", "suites", "--include", str(clash))
    assert rc == 2
    assert (
        f"duplicate suites entry 'tiny-shifts' in the catalogues of tta-bench-testplugin and "
        f"local:{clash}" in err
    )


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("syntax.py", "TTA_BENCH = {'methods': {\n", "syntax error line 1"),
        ("nothing.py", "x = 1\n", "declares no components: add a module-level `TTA_BENCH"),
        ("kind.py", "TTA_BENCH = {'method': {}}\n", "key 'method' is not a component kind"),
        ("call.py", "TTA_BENCH = dict(methods={})\n", "must be a dictionary literal"),
        ("names.py", "TTA_BENCH = {'losses': {1: abs}}\n", "key 1 is not a non-empty string"),
        ("sections.yaml", "methodz: {}\n", "has unknown sections ['methodz']"),
        ("list.yaml", "suites: [1, 2]\n", "each section must be a mapping"),
        ("broken.yaml", "suites: {a: [\n", "included catalogue"),
        ("notes.txt", "hello\n", "not a Python (.py) or YAML (.yaml, .yml) file"),
    ],
)
def test_a_bad_file_is_an_error_naming_it(capsys, tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    rc, out, err = cli(capsys, "ls", "methods", "--include", str(path))
    assert rc == 2 and not out
    assert str(path) in err and message in err, err


def test_a_missing_path_is_an_error_naming_it(capsys, tmp_path):
    rc, _, err = cli(capsys, "run", "--include", str(tmp_path / "nope"), "--cfg")
    assert rc == 2
    assert f"--include '{tmp_path / 'nope'}': no such file or directory" in err


def test_a_file_that_fails_to_import_is_an_error_naming_it(capsys, tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import no_such_module_here\n\ndef loss(logits): ...\n\n")
    path.write_text(path.read_text() + "TTA_BENCH = {'losses': {'broken': loss}}\n")
    out = tmp_path / "r.json"
    rc, _, err = cli(
        capsys,
        *("run", "--include", str(path), "--method", "norm_tent", "method.loss=broken"),
        *("seeds=[0]", "--output", str(out), "--quiet"),
    )
    assert rc == 2
    assert f"loss 'broken' ({path}:loss from local:{path}) failed to import" in err
    assert "No module named 'no_such_module_here'" in err


def test_an_included_component_is_validated_like_an_entry_point(capsys, tmp_path):
    path = tmp_path / "plain.py"
    path.write_text("class Plain:\n    pass\n\nTTA_BENCH = {'methods': {'plain': Plain}}\n")
    rc, _, err = cli(capsys, "run", "--include", str(path), "--method", "plain", "--cfg")
    assert rc == 2
    assert f"method 'plain' ({path}:Plain from local:{path}) is invalid: expected a subclass" in err


def test_the_python_api_includes_for_a_block(tmp_path, local):
    from tta_bench.include import included

    with included(local) as files:
        assert [f.path.name for f in files] == ["my_method.py", "suites.yaml"]
        assert registry("methods").origin("my-local").version == _sha(local / "my_method.py")[:12]
    assert "my-local" not in registry("methods").names()


@pytest.mark.parametrize("name", ["latin1.py", "latin1.yaml"])
def test_a_file_that_is_not_utf8_is_an_error_naming_it(capsys, tmp_path, name):
    path = tmp_path / name
    path.write_bytes("# café\nTTA_BENCH = {}\n".encode("latin-1"))
    rc, out, err = cli(capsys, "ls", "methods", "--include", str(path))
    assert rc == 2 and not out
    assert f"--include {str(path)!r}: not UTF-8 text (invalid byte 0xe9 at offset 5)" in err
    assert err.count("\n") == 1  # one line, no traceback


def test_a_non_utf8_file_in_an_included_directory_is_named(capsys, tmp_path):
    (tmp_path / "bad.py").write_bytes(b"\xff\xfe = 1\n")
    rc, _, err = cli(capsys, "ls", "methods", "--include", str(tmp_path))
    assert rc == 2
    assert f"--include {str(tmp_path / 'bad.py')!r}: not UTF-8 text" in err


def test_a_fifo_is_refused_without_opening_it(tmp_path):
    import os

    from .helpers import run_subprocess

    fifo = tmp_path / "pipe.py"
    os.mkfifo(fifo)
    # Opening a FIFO for reading blocks until a writer comes: a hang, not an error.
    proc = run_subprocess("ls", "methods", "--include", str(fifo), timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (
        f"tta-bench: error: --include {str(fifo)!r}: not a regular file (a FIFO); give a "
        "Python (.py) or YAML (.yaml, .yml) file, or a directory of them\n"
    )


def test_the_api_refuses_a_fifo_with_a_value_error(tmp_path):
    import os

    from tta_bench.include import add_include

    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)

    def hung(*_):
        raise TimeoutError("add_include opened the FIFO and waited for a writer")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        with pytest.raises(ValueError, match="not a regular file"):
            add_include(fifo)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_fifo_in_an_included_directory_is_refused_naming_it(capsys, tmp_path):
    import os

    fifo = tmp_path / "pipe.py"
    os.mkfifo(fifo)
    (tmp_path / "sub.yaml").mkdir()  # a folder is no component file: left alone
    rc, out, err = cli(capsys, "ls", "methods", "--include", str(tmp_path))
    assert rc == 2 and not out
    assert f"--include {str(fifo)!r}: not a regular file (a FIFO)" in err
