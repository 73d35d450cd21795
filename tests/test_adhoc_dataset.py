"""Any image folder or parquet set from the command line, without a plugin or a suite:
``tta-bench run --dataset imagefolder dataset.path=DIR ...`` builds an ad-hoc suite of the
registered dataset, whose protocol id encodes the dataset, its arguments (the folder's
absolute path) and the dataset's content fingerprint."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tta_bench.cli import main

CLASSES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def write_digits_folder(root: Path, per_class: int = 6, offset: int = 0) -> Path:
    """``root/<digit name>/<i>.png``: scikit-learn's digits (the default model's own
    classes) as 32 px RGB PNGs, ``per_class`` of each, starting at the ``offset``-th."""
    from PIL import Image
    from sklearn.datasets import load_digits

    bunch = load_digits()
    for k, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True, exist_ok=True)
        rows = np.flatnonzero(bunch.target == k)[offset : offset + per_class]
        for i, row in enumerate(rows):
            pixels = (bunch.images[row] / 16.0 * 255.0).round().astype(np.uint8)
            image = Image.fromarray(pixels).resize((32, 32), Image.BICUBIC).convert("RGB")
            image.save(root / name / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_digits_folder(tmp_path_factory.mktemp("adhoc") / "digits")


def _run(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def _record(capsys, tmp_path: Path, *args: str) -> tuple[dict, str]:
    """``tta-bench run *args`` writing to ``tmp_path / "r.json"`` (``--quiet``), asserted to
    exit 0: its results record and what it printed."""
    out = tmp_path / "r.json"
    rc, printed, err = _run(capsys, "run", *args, "--output", str(out), "--quiet")
    assert rc == 0, err
    return json.loads(out.read_text()), printed


def _protocol_id(capsys, *args: str) -> str:
    rc, out, err = _run(capsys, "run", *args, "--cfg")
    assert rc == 0, err
    return out.rstrip().splitlines()[-1].removeprefix("# protocol: ")


def test_an_image_folder_runs_end_to_end_under_a_shift(capsys, tmp_cache, folder, tmp_path):
    record, printed = _record(
        capsys,
        tmp_path,
        *("--dataset", "imagefolder", f"dataset.path={folder}"),
        *("protocol.shifts=[gaussian_noise]", "protocol.severities=[3]", "seeds=[0]"),
    )
    assert record["suite"] == "adhoc-imagefolder"
    assert record["model"]["name"] == "tiny-clip-digits"  # the catalogues' default model
    protocol = record["protocol"]
    assert protocol["id"].startswith("adhoc-imagefolder@v1-reset_each_shift-bs64-")
    assert protocol["dataset"] == "imagefolder"
    assert protocol["dataset_args"] == {"data_dir": str(folder.resolve())}
    assert protocol["data_fingerprint"].startswith("imagefolder/")
    assert protocol["shifts"] == ["gaussian_noise"] and protocol["severities"] == [3]
    assert protocol["templates"] == ["a photo of a {}."]  # the dataset's catalogue set
    [cell] = record["cells"]
    assert (cell["shift"], cell["severity"], cell["n"]) == ("gaussian_noise", 3, 60)
    assert cell["accuracy"] > 0.5  # the digits model reads its own classes off the folder
    assert f"zeroshot on adhoc-imagefolder ({protocol['id']})" in printed
    origins = {p["group"]: p["distribution"] for p in record["provenance"]["plugins"]}
    assert origins["tta_bench.datasets"] == "mura-plugin"


def test_without_shifts_the_clean_images_are_scored(capsys, tmp_cache, folder, tmp_path):
    record, printed = _record(
        capsys,
        tmp_path,
        *("--dataset", "imagefolder", f"dataset.path={folder}", "--method", "tent", "seeds=[0]"),
    )
    assert [(c["shift"], c["severity"], c["n"]) for c in record["cells"]] == [("clean", 1, 60)]
    assert record["protocol"]["batch_size"] == 64
    assert record["protocol"]["reset"] == "reset_each_shift"
    clean = next(p for p in record["provenance"]["plugins"] if p["group"] == "tta_bench.shifts")
    assert (clean["name"], clean["distribution"]) == ("clean", "tta-bench")
    assert "clean" in printed


def test_the_protocol_id_encodes_the_folder_and_its_contents(capsys, tmp_path, folder):
    base = _protocol_id(capsys, "--dataset", "imagefolder", f"dataset.path={folder}")
    # the same folder named another way (--data-dir, a relative path): the same id
    assert _protocol_id(capsys, "--dataset", "imagefolder", "--data-dir", str(folder)) == base
    # another folder with other images of the same classes: another id
    other = write_digits_folder(tmp_path / "other", offset=6)
    assert _protocol_id(capsys, "--dataset", "imagefolder", f"dataset.path={other}") != base
    # a copy of the same images in another place: another id (the path is an argument)
    copy = write_digits_folder(tmp_path / "copy")
    assert _protocol_id(capsys, "--dataset", "imagefolder", f"dataset.path={copy}") != base
    # protocol overrides apply as for any suite
    small = _protocol_id(
        capsys, "--dataset", "imagefolder", f"dataset.path={folder}", "protocol.batch_size=16"
    )
    assert small.startswith("adhoc-imagefolder@v1-reset_each_shift-bs16-")


def test_templates_come_from_an_option(capsys, folder):
    rc, out, err = _run(
        capsys,
        *("run", "--dataset", "imagefolder", f"dataset.path={folder}"),
        *("dataset.templates=['the number {}.','a handwritten {}.']", "--cfg"),
    )
    assert rc == 0, err
    assert "- the number {}." in out and "- a handwritten {}." not in out.split("method:")[0]
    default = _protocol_id(capsys, "--dataset", "imagefolder", f"dataset.path={folder}")
    assert out.rstrip().splitlines()[-1] != f"# protocol: {default}"
    rc, _, err = _run(
        capsys,
        *("run", "--dataset", "imagefolder", f"dataset.path={folder}"),
        *("dataset.templates=[nothing]", "--cfg"),
    )
    assert rc == 2 and "dataset imagefolder: prompt templates need exactly one '{}'" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["dataset.pth=/x"],
            "unknown dataset option 'dataset.pth' (did you mean 'dataset.path'?) for imagefolder; "
            "imagefolder takes: path, data_dir, classnames, templates, name",
        ),
        (["dataset.path=/no/such/folder"], "dataset imagefolder: imagefolder: /no/such/folder"),
        (["dataset.path=/x", "--suite", "digits-c"], "builds its own suite; drop --suite"),
        (["dataset.path=a,b"], "a dataset argument takes one value, not a sweep"),
    ],
)
def test_bad_dataset_arguments_exit_2_naming_them(capsys, args, message):
    rc, out, err = _run(capsys, "run", "--dataset", "imagefolder", *args, "--cfg")
    assert rc == 2 and not out
    assert message in err, err


def test_an_unknown_dataset_answers_did_you_mean(capsys):
    rc, _, err = _run(capsys, "run", "--dataset", "imagefoldr", "--cfg")
    assert rc == 2
    assert "unknown dataset 'imagefoldr'. Did you mean 'imagefolder'" in err


def test_a_dataset_argument_without_dataset_is_refused(capsys):
    rc, _, err = _run(capsys, "run", "dataset.path=/x", "--cfg")
    assert rc == 2 and "is an argument of --dataset NAME" in err


def test_a_parquet_file_takes_its_class_names_from_the_label_column(
    capsys, tmp_cache, folder, tmp_path
):
    import datasets

    files = sorted(folder.glob("*/*.png"))
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=CLASSES)}
    )
    ds = datasets.Dataset.from_dict(
        {"image": [str(f) for f in files], "label": [CLASSES.index(f.parent.name) for f in files]},
        features=features,
    )
    path = tmp_path / "test.parquet"
    ds.cast_column("image", datasets.Image(decode=True)).to_parquet(str(path))
    record, _ = _record(
        capsys, tmp_path, "--dataset", "parquet", f"dataset.path={path}", "seeds=[0]"
    )
    assert record["suite"] == "adhoc-parquet"
    assert record["cells"][0]["n"] == 60 and record["cells"][0]["accuracy"] > 0.5
