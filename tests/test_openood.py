"""OpenOOD v1.5's fixed ImageNet OOD splits (mura_plugin/datasets/openood.py) on a tree in
the published layout (``benchmark_imglist/imagenet/test_<set>.txt`` beside
``images_largescale/<set>/``): the list's images in its order as one unknown class, the
refusals (unknown set, no list, a listed image missing, a path leaving the image folder),
the warning of a partial list, ``tta-bench data check``'s inventory, and an open-set run
that mixes it into the digits stream."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mura_plugin.datasets.openood import OPENOOD_SETS, openood, read_imglist
from tta_bench.cli import main
from tta_bench.data import DataUnavailableError


def _tree(root: Path, name: str = "ninco", n: int = 40) -> Path:
    folder = "images_classic" if name == "textures" else "images_largescale"
    sub = "texture" if name == "textures" else name
    images = root / folder / sub
    images.mkdir(parents=True)
    lines = []
    rng = np.random.default_rng(0)
    for i in range(n):
        pixels = rng.integers(0, 256, (24, 24, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(images / f"img{i:03d}.png")
        lines.append(f"{sub}/img{i:03d}.png -1")
    lists = root / "benchmark_imglist" / "imagenet"
    lists.mkdir(parents=True, exist_ok=True)
    (lists / OPENOOD_SETS[name][1]).write_text("\n".join(lines) + "\n")
    return root


def test_a_set_is_its_list_in_order_as_one_unknown_class(tmp_path):
    root = _tree(tmp_path / "data" / "openood")
    with pytest.warns(UserWarning, match=r"40 image\(s\) .* published set has 5,879"):
        stream = openood(name="ninco", data_dir=str(tmp_path / "data"))  # the sub-folder
    assert stream.classnames == ["unknown (ninco)"] and len(stream) == 40
    assert stream.metadata["kind"] == "near"
    first = np.asarray(stream.dataset[0]["image"])
    want = np.asarray(Image.open(root / "images_largescale/ninco/img000.png"))
    assert np.array_equal(first, want)
    assert set(stream.dataset["label"]) == {0}


def test_refusals_name_the_value(tmp_path):
    root = _tree(tmp_path)
    with pytest.raises(ValueError, match="unknown set 'places'; available: ssb_hard, ninco"):
        openood(name="places", data_dir=str(root))
    with pytest.raises(ValueError, match="unknown set 'places'"):
        openood.check_args(name="places")  # before anything is read
    with pytest.raises(DataUnavailableError, match="test_textures.txt is missing"):
        openood(name="textures", data_dir=str(root))
    with pytest.raises(DataUnavailableError, match="needs --data-dir"):
        openood(name="ninco")
    (root / "images_largescale/ninco/img007.png").unlink()
    with pytest.raises(DataUnavailableError, match=r"1 of the 40 images .*img007.png"):
        openood(name="ninco", data_dir=str(root))
    bad = tmp_path / "bad.txt"
    bad.write_text("ninco/a.png -1\n../../etc/passwd -1\n")
    with pytest.raises(ValueError, match=r"bad.txt:2: the image path '../../etc/passwd' leaves"):
        read_imglist(bad)


def test_data_check_inventory(tmp_path):
    root = _tree(tmp_path)
    found = openood.inventory(name="ninco", data_dir=str(root))
    assert found.images == 40 and found.published == 5879 and found.missing_files == 0
    (root / "images_largescale/ninco/img001.png").unlink()
    partial = openood.inventory(name="ninco", data_dir=str(root))
    assert partial.missing_files == 1 and partial.images == 39 and partial.download
    absent = openood.inventory(name="inaturalist", data_dir=str(root))
    assert absent.where is None and absent.status == "missing"


def test_textures_are_read_from_the_classic_image_folder(tmp_path):
    _tree(tmp_path, "textures", n=3)
    with pytest.warns(UserWarning, match="published set has 5,160"):
        stream = openood(name="textures", data_dir=str(tmp_path))
    assert len(stream) == 3 and stream.metadata["kind"] == "far"


def test_an_open_set_run_mixes_it_into_the_digits_stream(tmp_path, capsys):
    root = _tree(tmp_path / "openood")
    out = tmp_path / "r.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the partial list's warning
        rc = main(
            ["run", "--method", "zeroshot", "--suite", "digits-open", "--quiet",
             "--output", str(out), "seeds=[0]", "protocol.shifts=[fog]",
             "protocol.ood_dataset=openood", "protocol.ood_ratio=0.15",
             f"protocol.ood_dataset_args={{name: ninco, data_dir: '{root}'}}"]
        )  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    record = json.loads(out.read_text())
    (cell,) = record["cells"]
    assert record["protocol"]["ood"]["dataset"] == "openood"
    assert cell["n_ood"] == round(0.15 / 0.85 * cell["n_known"])
    assert 0 <= cell["auroc"] <= 1


def test_the_noisy_suites_follow_zsntta_s_stream():
    """digits-noisy and imagenet-noisy: ZS-NTTA's OOD share 0.5 (their OOD_ratio 1.0),
    batches of 128, one pass never reset; ImageNet's OOD set (OpenOOD's iNaturalist list)
    repeated where it is smaller, as their resampling does."""
    from tta_bench.run.protocol import load_protocol

    digits = load_protocol("digits-noisy")
    assert (digits.batch_size, digits.reset, digits.ood["ratio"]) == (128, "continual", 0.5)
    assert "repeat" not in digits.ood  # 180 unknown digits suffice
    imagenet = load_protocol("imagenet-noisy")
    assert imagenet.ood["dataset"] == "openood" and imagenet.ood["repeat"] is True
    assert imagenet.ood["dataset_args"] == {"name": "inaturalist"}
    assert list(imagenet.shifts) == ["clean"] and imagenet.reset == "continual"
