"""``tta-bench data check --suite S --data-dir D`` on the published layouts (tests/
fixtures_data.py, and trees of the published size whose files are never decoded): found,
missing, partial (an emptied or removed class folder), mismatch (a folder of no class),
counts against the published size, the split file's version, what to download, ``--json``,
and the exit status (0 complete, 1 not, 2 bad input before anything is scanned). A run on
partial data warns, naming the folder: the loaders share the doctor's folder scan."""

from __future__ import annotations

import hashlib
import json
import shutil
import warnings
from pathlib import Path

import fixtures_data as fx
import numpy as np
import pytest

from mura_plugin.datasets.cifar import CORRUPTIONS
from tta_bench.catalog import entry
from tta_bench.cli import build_parser, main
from tta_bench.data import DataUnavailableError
from tta_bench.registry import registry

A_WNIDS = entry("datasets", "imagenet_a")["wnids"]
TENCH = "n01440764"  # an ImageNet class that is not one of ImageNet-A's 200


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def _check(capsys, suite: str, data: Path | None, *extra: str) -> tuple[int, dict]:
    """``data check --json``: (exit status, {domain: row})."""
    where = ["--data-dir", str(data)] if data is not None else []
    rc, out, err = _cli(capsys, "data", "check", "--suite", suite, *where, "--json", *extra)
    report = json.loads(out)
    assert report["complete"] == (rc == 0), (rc, err)
    return rc, {row["domain"]: row for row in report["domains"]}


def _published_imagenet_a(root: Path) -> Path:
    """ImageNet-A's published shape: 200 wnid folders, 7,500 files (38 or 37 per class).
    The files are empty: the check lists folders and never decodes an image."""
    for k, wnid in enumerate(A_WNIDS):
        (root / wnid).mkdir(parents=True)
        for i in range(38 if k < 100 else 37):
            (root / wnid / f"{i}.jpg").touch()
    return root


def _published_cifar10_c(root: Path) -> Path:
    """CIFAR-10-C's published arrays: 50,000 rows per corruption (10,000 per severity),
    written as sparse files: the check reads the array headers only."""
    folder = root / "CIFAR-10-C"
    folder.mkdir()
    for corruption in CORRUPTIONS:
        np.lib.format.open_memmap(
            folder / f"{corruption}.npy", mode="w+", dtype=np.uint8, shape=(50000, 32, 32, 3)
        ).flush()
    np.save(folder / "labels.npy", np.tile(np.arange(10), 5000))
    return folder


# -- bundled, found, missing ------------------------------------------------------------
def test_a_bundled_suite_needs_no_data_and_exits_0(capsys):
    rc, out, _ = _cli(capsys, "data", "check")  # the catalogues' default suite: digits-c
    assert rc == 0, out
    assert "digits    bundled" in out and "1 of 1 domain(s) found and complete" in out, out
    rc, rows = _check(capsys, "digits-open", None)
    assert rc == 0 and [r["status"] for r in rows.values()] == ["bundled", "bundled"]
    assert "digits (OOD set)" in rows


def test_the_published_cifar10_c_is_found_and_a_removed_corruption_is_missing(capsys, tmp_path):
    folder = _published_cifar10_c(tmp_path)
    rc, out, _ = _cli(capsys, "data", "check", "--suite", "cifar10-c", "--data-dir", str(tmp_path))
    assert rc == 0, out
    assert "15 of 15 domain(s) found and complete (15 found)" in out, out
    assert "cifar10_c/fog/5                found     10,000    10,000" in out, out
    (folder / "fog.npy").unlink()
    rc, out, _ = _cli(capsys, "data", "check", "--suite", "cifar10-c", "--data-dir", str(tmp_path))
    assert rc == 1 and "14 of 15 domain(s) found and complete (14 found, 1 missing)" in out, out
    [line] = [ln for ln in out.splitlines() if ln.startswith("  cifar10_c/fog/5:")]
    assert "zenodo.org/records/2535967" in line and "<data-dir>/CIFAR-10-C" in line, line
    _, rows = _check(capsys, "cifar10-c", tmp_path)
    assert rows["cifar10_c/fog/5"]["status"] == "missing"
    snow = rows["cifar10_c/snow/5"]
    assert (snow["status"], snow["images"], snow["published"]) == ("found", 10000, 10000), snow
    assert snow["where"] == str((folder / "snow.npy").resolve())


def test_a_missing_domain_says_what_to_download(capsys, tmp_path):
    fx.tree(tmp_path / "imagenet-a", A_WNIDS[:2], per_folder=1, ext=".jpg")
    rc, out, _ = _cli(
        capsys, "data", "check", "--suite", "imagenet-ood", "--data-dir", str(tmp_path)
    )
    assert rc == 1
    v2 = [ln for ln in out.splitlines() if ln.startswith("imagenet_v2-matched-frequency")]
    assert v2 and v2[0].split()[1:3] == ["missing", "-"], out
    [hint] = [ln for ln in out.splitlines() if ln.startswith("  imagenet_v2-matched-frequency:")]
    assert "vaishaal/ImageNetV2" in hint and "imagenetv2-matched-frequency-format-val" in hint


# -- class folders: empty, removed, unknown; counts against the published size -----------
def test_class_folders_empty_removed_or_unknown_are_named(capsys, tmp_path):
    root = _published_imagenet_a(tmp_path / "imagenet-a")
    _, rows = _check(capsys, "imagenet-ood", tmp_path)
    a = rows["imagenet_a"]
    assert a["status"] == "found" and a["images"] == a["published"] == 7500, a
    assert a["where"] == str(root.resolve()) and a["empty"] == a["absent"] == a["unknown"] == []

    emptied, removed = A_WNIDS[3], A_WNIDS[150]
    for f in (root / emptied).iterdir():
        f.unlink()
    shutil.rmtree(root / removed)
    _, rows = _check(capsys, "imagenet-ood", tmp_path)
    a = rows["imagenet_a"]
    assert a["status"] == "partial" and a["images"] == 7500 - 38 - 37, a
    assert a["empty"] == [emptied] and a["absent"] == [removed], a
    assert "imagenet-a.tar" in a["download"]

    (root / TENCH).mkdir()
    (root / TENCH / "0.jpg").touch()
    rc, out, _ = _cli(
        capsys, "data", "check", "--suite", "imagenet-ood", "--data-dir", str(tmp_path)
    )
    [row] = [ln for ln in out.splitlines() if ln.startswith("imagenet_a ")]
    assert row.split()[1] == "mismatch", out
    assert f"1 empty: {emptied}; 1 missing: {removed}; 1 unknown: {TENCH}" in row, row
    assert f"are no class of imagenet_a, e.g. {TENCH}: a run refuses the tree" in out, out


def test_a_run_on_an_emptied_class_folder_warns_naming_it(capsys, tmp_cache, tmp_path):
    root = tmp_path / "imagenet-a"
    fx.tree(root, A_WNIDS[:3], per_folder=2, ext=".jpg")
    for f in (root / A_WNIDS[1]).iterdir():
        f.unlink()
    out_file = tmp_path / "r.json"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rc = main(
            ["run", "--dataset", "imagenet_a", "--data-dir", str(tmp_path)]
            + ["--output", str(out_file), "--quiet", "seeds=[0]"]
        )
    assert rc == 0, capsys.readouterr().err
    said = {str(w.message) for w in caught if "partial" in str(w.message)}
    assert said, [str(w.message) for w in caught]
    for message in said:
        assert f"under {root.resolve()} hold no image file: {A_WNIDS[1]}" in message, message
    _, rows = _check(capsys, "imagenet-ood", tmp_path)
    assert rows["imagenet_a"]["empty"] == [A_WNIDS[1]] and rows["imagenet_a"]["images"] == 4


def test_the_loader_warns_naming_a_removed_class_folder(tmp_path):
    root = _published_imagenet_a(tmp_path / "imagenet-a")
    load = registry("datasets").get("imagenet_a")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the whole published tree: not a word
        assert len(load(data_dir=str(tmp_path))) == 7500
    shutil.rmtree(root / A_WNIDS[7])
    with pytest.warns(UserWarning, match="partial") as caught:
        stream = load(data_dir=str(tmp_path))
    [message] = [str(w.message) for w in caught]
    assert f"1 of the 200 class folders are missing under {root.resolve()}: {A_WNIDS[7]}" in message
    assert f"{len(stream):,} image(s) where the published set has 7,500" in message, message


# -- split files: version, count, listed images ------------------------------------------
def test_a_coop_split_file_is_versioned_and_counted_against_the_published_test_size(
    capsys, tmp_path
):
    layout = fx.coop_layout(tmp_path, "dtd")
    split_file = layout["folder"] / "split_zhou_DescribableTextures.json"
    digest = hashlib.sha256(split_file.read_bytes()).hexdigest()[:12]
    rc, rows = _check(capsys, "cross-domain-10", tmp_path)
    dtd = rows["dtd"]
    assert rc == 1 and dtd["status"] == "partial" and dtd["images"] == 4, dtd
    assert dtd["published"] == 1692 and dtd["missing_files"] == 0
    assert dtd["split_file"] == f"split_zhou_DescribableTextures.json sha256:{digest}, 4 test"
    assert any("lists 4 test images; CoOp's published split lists 1,692" in n for n in dtd["notes"])
    assert rows["caltech101"]["status"] == "missing"

    with pytest.warns(UserWarning, match="where the published set has 1,692"):
        registry("datasets").get("dtd")(data_dir=str(tmp_path))

    folder = Path(layout["test"][1][0]).parts[0]  # label 2's class folder: two test images
    for rel, _, _ in layout["test"]:
        if rel.startswith(folder + "/"):
            (layout["image_dir"] / rel).unlink()
    rc, out, _ = _cli(
        capsys, "data", "check", "--suite", "cross-domain-10", "--data-dir", str(tmp_path)
    )
    [row] = [ln for ln in out.splitlines() if ln.startswith("dtd ")]
    assert f"1 empty: {folder}; 2 listed file(s) missing" in row and " 2 " in row, row
    assert "2 of the 4 images its test split lists are missing" in out, out
    with pytest.raises(DataUnavailableError, match="2 of the 4 images"):
        registry("datasets").get("dtd")(data_dir=str(tmp_path))


def test_a_local_hf_copy_is_counted_from_its_parquet_files(capsys, tmp_path):
    fx.hf_parquet(tmp_path / "imagenet-r" / "test-00000-of-00001.parquet", [0, 1, 2])
    _, rows = _check(capsys, "imagenet-ood", tmp_path)
    r = rows["imagenet_r"]
    assert r["status"] == "partial" and r["images"] == 3 and r["published"] == 30000, r
    assert r["notes"] == ["a local HF copy (split test)"]


def test_a_dataset_without_an_inventory_is_counted_by_building_it(capsys, tmp_path):
    """The harness's own path for any registered dataset (here an included one)."""
    (tmp_path / "local.py").write_text(
        "from mura_plugin.datasets.folder import imagefolder\n\n\n"
        "def plain_digits(*, data_dir=None):\n"
        "    return imagefolder(data_dir=data_dir, name='plain_digits')\n\n\n"
        'TTA_BENCH = {"datasets": {"plain-digits": plain_digits}}\n'
    )
    (tmp_path / "local.yaml").write_text(
        "datasets:\n  plain-digits: {templates: simple}\n"
        "suites:\n  plain-digits-c:\n    dataset: plain-digits\n    shifts: [fog]\n"
        "    severities: [1]\n    batch_size: 8\n    reset: reset_each_shift\n"
    )
    data = fx.digits_folder(tmp_path / "digits", per_class=3)
    include = ["--include", str(tmp_path / "local.py"), "--include", str(tmp_path / "local.yaml")]
    rc, rows = _check(capsys, "plain-digits-c", data, *include)
    assert rc == 0 and rows["plain_digits"]["status"] == "found", rows
    assert rows["plain_digits"]["images"] == 30 and rows["plain_digits"]["where"] == str(data)
    assert "counted by building the stream" in rows["plain_digits"]["notes"][0]


# -- exit status and bad input -----------------------------------------------------------
def test_bad_input_exits_2_before_anything_is_scanned(capsys, tmp_path):
    rc, out, err = _cli(capsys, "data", "check", "--suite", "imagenet-odd", "--data-dir", "x")
    assert rc == 2 and not out
    assert "unknown suite 'imagenet-odd'. Did you mean 'imagenet-ood'" in err, err
    assert "Available: cifar10-c, cifar100-c, cross-domain-10" in err, err
    rc, out, err = _cli(capsys, "data", "check", "--suite", "cifar10-c", "--data-dir", "nowhere")
    assert rc == 2 and not out and "--data-dir 'nowhere' does not exist" in err, err
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    rc, out, err = _cli(capsys, "data", "check", "--data-dir", str(a_file))
    assert rc == 2 and not out and "is not a folder" in err, err
    with pytest.raises(SystemExit) as info:
        main(["data", "chek"])
    assert info.value.code == 2 and "invalid choice: 'chek' (choose from 'check')" in (
        capsys.readouterr().err
    )


def test_the_help_says_what_each_exit_status_means():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    text = " ".join(sub.choices["data"].format_help().split())
    assert "Exit status 0 when every domain is found and complete (or bundled), 1 when" in text
    assert "2 for bad input (an unknown suite, a --data-dir that is not a folder)" in text
