"""``tta-bench run --dataset imagefolder`` on folders a careless user might hand it: one
class only (scores 100%: a warning naming the folder), broken ``*.png`` links (bad images
under ``--on-bad-image``), and an emptied class folder (a warning: the data is partial)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import fixtures_data as fx

from tta_bench.cli import main


def _run(capsys, tmp_path: Path, *args: str) -> tuple[int, str, list[str], dict | None]:
    """``tta-bench run --dataset imagefolder *args --quiet`` writing ``tmp_path/r.json``:
    (exit status, stderr, the messages of the warnings given, the record or None)."""
    out = tmp_path / "r.json"
    out.unlink(missing_ok=True)
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rc = main(["run", "--dataset", "imagefolder", *args, "--output", str(out), "--quiet"])
    err = capsys.readouterr().err
    record = json.loads(out.read_text()) if out.exists() else None
    return rc, err, [str(w.message) for w in caught], record


def test_a_one_class_folder_warns_that_its_accuracy_means_nothing(capsys, tmp_cache, tmp_path):
    folder = fx.digits_folder(tmp_path / "only-zeros", classes=["zero"])
    rc, err, said, record = _run(capsys, tmp_path, f"dataset.path={folder}")
    assert rc == 0, err
    assert record["cells"][0]["accuracy"] == 1.0  # a classifier over one class: always right
    [message] = [m for m in said if "single class" in m]
    assert str(folder) in message and "'zero'" in message and "meaningless" in message, message


def test_broken_links_are_skipped_and_reported_or_fail_naming_them(capsys, tmp_cache, tmp_path):
    folder = fx.digits_folder(tmp_path / "digits")
    loop = folder / "three" / "loop.png"
    loop.symlink_to("loop.png")
    dangling = folder / "five" / "gone.png"
    dangling.symlink_to("moved/away.png")
    rc, err, _, _ = _run(capsys, tmp_path, f"dataset.path={folder}")
    # the run stops at the first batch holding a bad image, naming the file(s) in it
    assert rc == 2 and "image(s) cannot be decoded" in err and "a symbolic link" in err, err
    assert (str(loop) in err or str(dangling) in err) and "--on-bad-image=skip" in err, err
    rc, err, _, record = _run(capsys, tmp_path, f"dataset.path={folder}", "--on-bad-image", "skip")
    assert rc == 0, err
    [(name, bad)] = record["skipped_images"].items()
    assert sorted(b["path"] for b in bad) == sorted([str(loop), str(dangling)]), bad
    assert record["cells"][0]["n"] == 20  # the 20 images, the two links left out


def test_an_emptied_class_folder_warns_that_the_data_is_partial(capsys, tmp_cache, tmp_path):
    folder = fx.digits_folder(tmp_path / "digits")
    for f in (folder / "seven").iterdir():
        f.unlink()
    rc, err, said, record = _run(capsys, tmp_path, f"dataset.path={folder}")
    assert rc == 0, err
    [message] = {m for m in said if "partial" in m}  # one message (given per build)
    assert str(folder) in message and "seven" in message, message
