"""Dataset factories on small local fixtures in the published layouts (offline), the
ImageNet-A/-R class mapping, the decoded-image cache and the real-data suites via the CLI."""

from __future__ import annotations

import json
import os

import fixtures_data as fx
import numpy as np
import pytest

from tta_bench.data import BadImageError, DataUnavailableError
from tta_bench.registry import registry
from tta_bench.run.cache import cache_path, decode


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """Never touch the network; an empty HF datasets cache."""
    import datasets
    import huggingface_hub.constants as hc

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def factory(name):
    return registry("datasets").get(name)


# -- CIFAR ---------------------------------------------------------------------------------
def test_cifar10_c_rows_of_a_severity(tmp_path, tmp_cache):
    fx.cifar_c(tmp_path, n=6)
    with pytest.warns(UserWarning, match="rows per severity"):
        s = factory("cifar10_c")(shift="fog", severity=3, data_dir=str(tmp_path))
    assert len(s) == 6 and s.classnames[0] == "airplane" and s.templates == ["a photo of a {}."]
    assert s.labels.tolist() == [0, 1, 2, 3, 4, 5]
    k = fx.CORRUPTIONS.index("fog")
    dec = decode(s, 32)
    assert dec.images[:, 0, 0, 0].tolist() == [30 + i + k for i in range(6)]  # severity 3 rows
    assert not (tmp_cache / "decoded").exists() or not any((tmp_cache / "decoded").iterdir())
    with pytest.warns(UserWarning):
        s5 = factory("cifar10_c")(shift="fog", severity=5, data_dir=str(tmp_path / "CIFAR-10-C"))
    assert decode(s5, 32).images[0, 0, 0, 0] == 50 + k
    assert s5.fingerprint != s.fingerprint


def test_cifar_c_errors_say_what_to_download(tmp_path, tmp_cache):
    with pytest.raises(DataUnavailableError, match=r"zenodo.org/records/2535967.*--data-dir"):
        factory("cifar10_c")(shift="fog", severity=5, data_dir=str(tmp_path))
    with pytest.raises(DataUnavailableError, match="3555552"):
        factory("cifar100_c")(shift="fog", severity=5)
    fx.cifar_c(tmp_path, n=2, corruptions=["fog"])
    with pytest.raises(DataUnavailableError, match="snow.npy is missing"):
        factory("cifar10_c")(shift="snow", severity=5, data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="unknown corruption 'fgo'.*gaussian_noise"):
        factory("cifar10_c")(shift="fgo", severity=5, data_dir=str(tmp_path))
    assert not (tmp_cache / "decoded").exists()


def test_the_cifar_train_split_is_the_c_suites_source(tmp_path):
    """The CIFAR-C suites name ``cifar10``/``cifar100`` ``split=train`` as their source
    (EATA's Fisher, RMT's and SANTA's labelled source): it reads the five training batches
    in order (CIFAR-100: its one ``train`` file); a split that is neither is refused."""
    import pickle

    from tta_bench.run.protocol import load_protocol

    d = tmp_path / "cifar-10-batches-py"
    d.mkdir()
    for i in range(1, 6):
        data = np.full((2, 3072), i, dtype=np.uint8)
        with open(d / f"data_batch_{i}", "wb") as fh:
            pickle.dump({b"data": data, b"labels": [i, i - 1]}, fh)
    assert load_protocol("cifar10-c").source == {
        "dataset": "cifar10",
        "dataset_args": {"split": "train"},
    }
    with pytest.warns(UserWarning, match="10 image"):  # not the 50,000 published
        s = factory("cifar10")(split="train", data_dir=str(tmp_path))
    assert s.name == "cifar10-train"
    assert s.labels.tolist() == [1, 0, 2, 1, 3, 2, 4, 3, 5, 4]
    (d / "data_batch_4").unlink()
    with pytest.raises(DataUnavailableError, match="data_batch_4"):
        factory("cifar10")(split="train", data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="unknown split 'val'; available: test"):
        factory("cifar10")(split="val", data_dir=str(tmp_path))


def test_cifar10_clean_from_pickle_and_missing_hub(tmp_path):
    import pickle

    d = tmp_path / "cifar-10-batches-py"
    d.mkdir()
    data = np.arange(4 * 3072, dtype=np.int64).reshape(4, 3072) % 256
    with open(d / "test_batch", "wb") as fh:
        pickle.dump({b"data": data.astype(np.uint8), b"labels": [3, 1, 4, 1]}, fh)
    s = factory("cifar10")(data_dir=str(tmp_path))
    assert s.labels.tolist() == [3, 1, 4, 1] and len(s.classnames) == 10
    img = decode(s, 32, use_cache=False).images
    assert img[0, 0, 0].tolist() == [0, 1024 % 256, 2048 % 256]  # CHW pickle -> HWC
    with pytest.raises(DataUnavailableError, match="uoft-cs/cifar100.*--data-dir"):
        factory("cifar100")()


# -- ImageNet family -----------------------------------------------------------------------
def test_imagenet_a_and_r_class_mapping(tmp_path):
    from mura_plugin.datasets.imagenet import imagenet_indices
    from tta_bench.catalog import entry

    wnids = entry("datasets", "imagenet")["wnids"]
    names = entry("datasets", "imagenet")["classnames"]
    assert len(wnids) == len(set(wnids)) == 1000 and len(names) == 1000 and wnids == sorted(wnids)
    assert (wnids[1], names[1]) == ("n01443537", "goldfish")
    assert (wnids[94], names[94]) == ("n01833805", "hummingbird")
    for sub in ("imagenet_a", "imagenet_r"):
        w = entry("datasets", sub)["wnids"]
        assert len(w) == len(set(w)) == 200 and set(w) <= set(wnids) and w == sorted(w)
    # The published index lists shipped with timm (independent of our catalogue).
    import timm

    info = os.path.join(os.path.dirname(timm.__file__), "data", "_info")
    for sub, fname in (
        ("imagenet_a", "imagenet_a_indices.txt"),
        ("imagenet_r", "imagenet_r_indices.txt"),
    ):
        with open(os.path.join(info, fname)) as fh:
            assert imagenet_indices(sub) == [int(x) for x in fh.read().split()]

    fx.tree(tmp_path / "imagenet-r", ["n01443537", "n01833805", "n02123045"], per_folder=1)
    fx.tree(tmp_path / "imagenet-a", ["n01498041", "n01531178"], per_folder=1, ext=".jpg")
    r = factory("imagenet_r")(data_dir=str(tmp_path))
    a = factory("imagenet_a")(data_dir=str(tmp_path))
    assert len(r.classnames) == len(a.classnames) == 200
    assert [r.classnames[y] for y in r.labels] == ["goldfish", "hummingbird", "tabby cat"]
    assert [r.metadata["imagenet_indices"][y] for y in r.labels] == [1, 94, 281]
    assert [a.classnames[y] for y in a.labels] == ["stingray", "goldfinch"]
    assert [a.metadata["imagenet_indices"][y] for y in a.labels] == [6, 11]
    assert decode(a, 224, use_cache=False).images.shape == (2, 224, 224, 3)


def test_imagenet_r_local_hf_copy_with_wnid_labels(tmp_path):
    import datasets

    files = fx.tree(tmp_path / "src", ["n01443537", "n01833805"], per_folder=1)
    ds = datasets.Dataset.from_dict(
        {
            "image": [str(f) for f in files],
            "wnid": ["n01833805", "n01443537"],
            "class_name": ["x", "y"],
        },
        features=datasets.Features(
            {
                "image": datasets.Image(),
                "wnid": datasets.Value("string"),
                "class_name": datasets.Value("string"),
            }
        ),
    )
    ds.save_to_disk(str(tmp_path / "imagenet-r"))
    r = factory("imagenet_r")(data_dir=str(tmp_path))
    assert r.dataset.column_names == ["image", "label"]
    assert [r.classnames[y] for y in r.labels] == ["hummingbird", "goldfish"]


def test_imagenet_c_tree_subset_and_native_size(tmp_path):
    import datasets

    root = tmp_path / "imagenet-c"
    for c in ("fog", "snow"):
        fx.tree(root / c / "5", ["n01440764", "n01443537"], per_folder=4, size=(224, 224))
    with pytest.raises(ValueError, match="multiple of 1000"):
        factory("imagenet_c")(shift="fog", severity=5, data_dir=str(tmp_path), subset=500)
    fog = factory("imagenet_c")(shift="fog", severity=5, data_dir=str(tmp_path), subset=2000)
    snow = factory("imagenet_c")(shift="snow", severity=5, data_dir=str(tmp_path), subset=2000)
    assert fog.native_size == 224 and len(fog) == 4 and fog.labels.tolist() == [0, 0, 1, 1]

    def names(s):
        raw = s.dataset.cast_column("image", datasets.Image(decode=False))["image"]
        return [os.path.basename(p["path"]) for p in raw]

    assert names(fog) == names(snow)  # the same images in every domain
    full = factory("imagenet_c")(shift="fog", severity=5, data_dir=str(tmp_path))
    assert len(full) == 8 and full.fingerprint != fog.fingerprint
    assert decode(full, 224, use_cache=False).images.shape == (8, 224, 224, 3)
    with pytest.raises(ValueError, match="must not be resized"):
        decode(full, 32)
    with pytest.raises(DataUnavailableError, match="imagenet-c/fog/3 is missing"):
        factory("imagenet_c")(shift="fog", severity=3, data_dir=str(tmp_path))
    with pytest.raises(DataUnavailableError, match="2235448"):
        factory("imagenet_c")(shift="fog", severity=5)


def test_imagenet_v2_numeric_folders_and_sketch(tmp_path):
    v2 = tmp_path / "imagenetv2-matched-frequency-format-val"
    fx.tree(v2, ["0", "2", "10"], per_folder=1, ext=".jpeg")
    s = factory("imagenet_v2")(data_dir=str(tmp_path))
    assert s.labels.tolist() == [0, 2, 10] and len(s.classnames) == 1000  # not "10" < "2"
    with pytest.raises(ValueError, match="unknown variant"):
        factory("imagenet_v2")(variant="matched", data_dir=str(tmp_path))
    fx.tree(tmp_path / "sketch", ["n01440764", "n15075141"], per_folder=1)
    sk = factory("imagenet_sketch")(data_dir=str(tmp_path))
    assert sk.labels.tolist() == [0, 999] and sk.classnames[999] == "toilet paper"
    with pytest.raises(DataUnavailableError, match="songweig/imagenet_sketch"):
        factory("imagenet_sketch")()
    ood = factory("imagenet_ood")(shift="imagenet_v2", severity=1, data_dir=str(tmp_path))
    assert ood.labels.tolist() == [0, 2, 10]
    with pytest.raises(ValueError, match="one level"):
        factory("imagenet_ood")(shift="imagenet_v2", severity=2, data_dir=str(tmp_path))


def test_templates_in_catalogue():
    from tta_bench.catalog import catalog

    t = catalog()["templates"]
    assert len(t["clip-imagenet-80"]["templates"]) == 80 and t["simple"]["templates"] == [
        "a photo of a {}."
    ]
    assert all(x.count("{}") == 1 for x in t["clip-imagenet-80"]["templates"])
    assert (
        len(factory("cifar100_c").__module__)
        and len(
            set(
                __import__("tta_bench.catalog", fromlist=["entry"]).entry("datasets", "cifar100")[
                    "classnames"
                ]
            )
        )
        == 100
    )


# -- any local dataset ---------------------------------------------------------------------
def test_imagefolder_and_parquet(tmp_path):
    import datasets

    fx.tree(tmp_path / "folder", ["cat", "dog"], per_folder=2, ext=".png")
    s = factory("imagefolder")(data_dir=str(tmp_path / "folder"), classnames=["a cat", "a dog"])
    assert s.labels.tolist() == [0, 0, 1, 1] and s.classnames == ["a cat", "a dog"]
    with pytest.raises(ValueError, match="1 class names for 2 folders"):
        factory("imagefolder")(data_dir=str(tmp_path / "folder"), classnames=["x"])
    files = fx.tree(tmp_path / "pq-src", ["a", "b"], per_folder=1)
    ds = datasets.Dataset.from_dict(
        {"img": [{"bytes": f.read_bytes(), "path": None} for f in files], "y": [1, 0]},
        features=datasets.Features({"img": datasets.Image(), "y": datasets.Value("int64")}),
    )
    (tmp_path / "pq").mkdir()
    ds.to_parquet(str(tmp_path / "pq" / "test.parquet"))
    p = factory("parquet")(
        data_dir=str(tmp_path / "pq"), classnames=["x", "y"], image_column="img", label_column="y"
    )
    assert p.labels.tolist() == [1, 0]
    assert decode(p, 32, use_cache=False).images.shape == (2, 32, 32, 3)


def _raw_paths(stream) -> list[str]:
    import datasets

    raw = stream.dataset.cast_column("image", datasets.Image(decode=False))["image"]
    return [r["path"] for r in raw]


def test_broken_image_links_are_listed_and_follow_the_bad_image_policy(tmp_path, tmp_cache):
    """A dangling ``*.png`` link and a link loop are bad images like a corrupt file: listed
    (never silently dropped, never aborting the listing), then skipped and reported under
    ``skip`` and an error naming each under ``fail``, by every source (decoded cache and
    streamed decoding)."""
    from tta_bench.run.sources import open_source

    root = tmp_path / "f"
    fx.tree(root, ["cat", "dog"], per_folder=2, ext=".png")
    dangling = root / "cat" / "gone.png"
    dangling.symlink_to("nowhere.png")
    (root / "dog" / "folder.png").mkdir()  # a folder named like an image is not an image
    s = factory("imagefolder")(data_dir=str(root))
    assert str(dangling) in _raw_paths(s) and len(s) == 5
    loop = root / "dog" / "loop.png"
    loop.symlink_to("loop.png")
    (root / "knot").symlink_to("knot")  # a looping link beside the class folders: no class
    s = factory("imagefolder")(data_dir=str(root))
    assert s.classnames == ["cat", "dog"]
    assert [os.path.basename(p) for p in _raw_paths(s)] == [
        "gone.png", "img0.png", "img1.png", "img0.png", "img1.png", "loop.png"
    ]  # fmt: skip
    assert s.labels.tolist() == [0, 0, 0, 1, 1, 1]
    broken = [(0, str(dangling)), (5, str(loop))]
    skipped = decode(s, 24, on_bad_image="skip")
    assert [(b["index"], b["path"]) for b in skipped.bad] == broken
    assert "symbolic link" in skipped.bad[0]["error"] and "loop" in skipped.bad[1]["error"]
    with pytest.raises(BadImageError, match="2 image") as info:
        decode(s, 24)
    assert str(dangling) in str(info.value) and str(loop) in str(info.value)
    streamed = open_source(s, 24, cache="never", on_bad_image="skip")
    got = streamed.fetch(np.arange(len(s)))
    assert got.kept.tolist() == [1, 2, 3, 4]
    assert [(b["index"], b["path"]) for b in got.bad] == broken
    failing = open_source(s, 24, cache="never")
    with pytest.raises(BadImageError, match=str(loop)):
        failing.check_bad(failing.fetch(np.arange(len(s))).bad)


def _partial_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "partial" in str(w.message)]


def _build(fn, **kwargs):
    """``fn(**kwargs)`` and the messages of the "partial data" warnings it gave."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stream = fn(**kwargs)
    return stream, _partial_warnings(caught)


def test_empty_class_folders_warn_once_naming_them_as_partial_data(tmp_path):
    """A class folder of a published layout (ImageNet-A/-R/-Sketch/-C wnid trees, -V2 index
    folders, an image folder) with no image file, or a class link that leads nowhere:
    one warning per stream listing them all, saying the data is partial."""
    a_root = tmp_path / "imagenet-a"
    wnids = ["n01498041", "n01531178", "n01534433"]
    fx.tree(a_root, wnids, per_folder=1, ext=".jpg")
    full, [said] = _build(factory("imagenet_a"), data_dir=str(tmp_path))
    assert len(full) == 3 and "hold no image file" not in said, said  # no class folder empty
    assert "197 of the 200 class folders are missing" in said, said  # but 197 are absent
    (a_root / wnids[1] / "img0.jpg").unlink()  # emptied
    (a_root / wnids[2] / "img0.jpg").rename(a_root / wnids[2] / "img0.txt")  # no image file
    a, said = _build(factory("imagenet_a"), data_dir=str(tmp_path))
    assert len(a) == 1
    [message] = said
    assert str(a_root.resolve()) in message and "2 class folder(s)" in message, message
    assert wnids[1] in message and wnids[2] in message and wnids[0] not in message, message
    (a_root / "n01558993").symlink_to("moved-away")  # a class folder link that is dangling
    _, [message] = _build(factory("imagenet_a"), data_dir=str(tmp_path))
    assert "3 class folder(s)" in message and "n01558993 (a symbolic link" in message, message

    fx.tree(tmp_path / "f", ["cat", "dog"], per_folder=1)
    (tmp_path / "f" / "dog" / "img0.JPEG").unlink()
    (tmp_path / "f" / "emu").mkdir()
    s, [message] = _build(factory("imagefolder"), data_dir=str(tmp_path / "f"))
    assert s.classnames == ["cat", "dog", "emu"] and "dog, emu" in message, message

    v2 = tmp_path / "imagenetv2-matched-frequency-format-val"
    fx.tree(v2, ["0", "2"], per_folder=1, ext=".jpeg")
    (v2 / "2" / "img0.jpeg").unlink()
    _, [message] = _build(factory("imagenet_v2"), data_dir=str(tmp_path))
    assert str(v2.resolve()) in message and ": 2;" in message, message
    (v2 / "0" / "img0.jpeg").unlink()  # no image at all: an error, not an empty stream
    with pytest.raises(DataUnavailableError, match="imagenet_v2: no image files"):
        factory("imagenet_v2")(data_dir=str(tmp_path))

    c_root = tmp_path / "imagenet-c"
    fx.tree(c_root / "fog" / "5", wnids[:2], per_folder=2, size=(224, 224))
    for f in (c_root / "fog" / "5" / wnids[1]).iterdir():
        f.unlink()
    for subset in (None, 1000):
        _, [message] = _build(
            factory("imagenet_c"), shift="fog", severity=5, data_dir=str(tmp_path), subset=subset
        )
        assert "fog/5" in message and wnids[1] in message, message


# -- local HF copies: the requested split only, by the hub's file naming ------------------
def pixel_values(stream):
    """The distinct pixel values of a stream's images (each split's images hold one)."""
    return sorted(set(decode(stream, 32, use_cache=False).images[:, 0, 0, 0].tolist()))


def test_cifar10_hub_layout_loads_only_the_test_split(tmp_path):
    # huggingface-cli download uoft-cs/cifar10 --repo-type dataset --local-dir <data>/cifar10
    root = tmp_path / "cifar10" / "plain_text"
    fx.hf_parquet(root / "train-00000-of-00001.parquet", [0, 1, 2], 200, image_column="img")
    fx.hf_parquet(root / "test-00000-of-00001.parquet", [3, 4], 50, image_column="img")
    s = factory("cifar10")(data_dir=str(tmp_path))
    assert s.labels.tolist() == [3, 4] and pixel_values(s) == [50]
    assert s.metadata["files"] == ["plain_text/test-00000-of-00001.parquet"]


def test_cifar100_hub_layout_loads_only_the_test_split(tmp_path):
    root = tmp_path / "cifar100" / "cifar100"
    for split, fine, value in (("train", [7, 8, 9], 200), ("test", [99, 0], 60)):
        fx.hf_parquet(
            root / f"{split}-00000-of-00001.parquet",
            fine,
            value,
            image_column="img",
            label_column="fine_label",
            extra={"coarse_label": [1] * len(fine)},
        )
    s = factory("cifar100")(data_dir=str(tmp_path))
    assert s.labels.tolist() == [99, 0] and pixel_values(s) == [60]


def test_imagenet_hub_layout_loads_only_validation(tmp_path):
    # ILSVRC/imagenet-1k: data/{train,validation,test}-NNNNN-of-NNNNN.parquet; test is unlabeled
    data = tmp_path / "imagenet-1k" / "data"
    fx.hf_parquet(data / "train-00000-of-00002.parquet", [0, 1], 200)
    fx.hf_parquet(data / "train-00001-of-00002.parquet", [2], 200)
    fx.hf_parquet(data / "validation-00000-of-00001.parquet", [2, 999], 80)
    fx.hf_parquet(data / "test-00000-of-00001.parquet", [-1, -1], 10)
    s = factory("imagenet")(data_dir=str(tmp_path))
    assert s.labels.tolist() == [2, 999] and pixel_values(s) == [80]
    (data / "validation-00000-of-00001.parquet").unlink()
    with pytest.raises(
        DataUnavailableError,
        match=r"split 'validation'.*identified: train \(2 files\), test \(1 file\).*"
        r"data/test-00000-of-00001\.parquet",
    ):
        factory("imagenet")(data_dir=str(tmp_path))


def test_split_folders_at_any_depth_never_by_substring(tmp_path):
    root = tmp_path / "pq"
    fx.hf_parquet(root / "export" / "test" / "part-0.parquet", [0], 10)
    fx.hf_parquet(root / "export" / "val" / "part-0.parquet", [1], 20)
    fx.hf_parquet(root / "trainval" / "part-0.parquet", [1], 30)
    fx.hf_parquet(root / "pretrained" / "part-0.parquet", [0], 40)

    def load(split):
        return factory("parquet")(data_dir=str(root), classnames=["x", "y"], split=split)

    assert pixel_values(load("test")) == [10]
    assert pixel_values(load("validation")) == pixel_values(load("val")) == [20]
    # 'train' is neither 'trainval/' nor 'pretrained/': no train split here
    with pytest.raises(
        DataUnavailableError,
        match=r"split 'train'.*identified: validation \(1 file\), test \(1 file\).*"
        r"files found \(4\):.*pretrained/part-0\.parquet.*trainval/part-0\.parquet",
    ):
        load("train")


def test_split_named_files_and_no_split_given(tmp_path):
    root = tmp_path / "pq"
    fx.hf_parquet(root / "train.parquet", [0, 1, 0], 200)
    fx.hf_parquet(root / "test.parquet", [1], 50)
    p = factory("parquet")(data_dir=str(root), classnames=["x", "y"], split="test")
    assert p.labels.tolist() == [1] and pixel_values(p) == [50]
    with pytest.raises(ValueError, match=r"several splits \(train, test\).*split="):
        factory("parquet")(data_dir=str(root), classnames=["x", "y"])
    # a file named explicitly is used as is, unless its name says it is another split
    one = factory("parquet")(data_dir=str(root / "train.parquet"), classnames=["x", "y"])
    assert len(one) == 3
    with pytest.raises(DataUnavailableError, match=r"train\.parquet.*split 'train'.*not 'test'"):
        factory("parquet")(
            data_dir=str(root / "train.parquet"), classnames=["x", "y"], split="test"
        )


def test_unnamed_parquet_and_save_to_disk_splits(tmp_path):
    import datasets

    fx.hf_parquet(tmp_path / "a" / "cifar10" / "cifar10.parquet", [1, 2], image_column="img")
    with pytest.raises(
        DataUnavailableError, match=r"split 'test'.*identified: none.*cifar10\.parquet.*test/"
    ):
        factory("cifar10")(data_dir=str(tmp_path / "a"))
    src = fx.hf_parquet(tmp_path / "src.parquet", [5, 6], image_column="img")
    train = datasets.Dataset.from_parquet(str(src))
    test = train.select([1])
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "b/cifar10"))
    assert factory("cifar10")(data_dir=str(tmp_path / "b")).labels.tolist() == [6]
    # a saved Dataset names its split: another split's name is an error; 'train' (also
    # what Dataset.from_* records by default) a warning
    for saved in ("validation", "train"):
        tagged = datasets.Dataset.from_dict(train.to_dict(), features=train.features, split=saved)
        tagged.save_to_disk(str(tmp_path / saved / "cifar10"))
    with pytest.raises(DataUnavailableError, match=r"saved split 'validation', not 'test'"):
        factory("cifar10")(data_dir=str(tmp_path / "validation"))
    with pytest.warns(UserWarning, match=r"saved split 'train', not 'test'"):
        assert len(factory("cifar10")(data_dir=str(tmp_path / "train"))) == 2


@pytest.mark.parametrize(
    "layout",
    [
        ["plain_text/train-00000-of-00001.parquet", "plain_text/test-00000-of-00001.parquet"],
        [
            "data/train-00000-of-00002.parquet",
            "data/train-00001-of-00002.parquet",
            "data/validation-00000-of-00001.parquet",
            "data/test-00000-of-00001.parquet",
            "data/extra-00000-of-00001.parquet",
        ],
        ["train/a.parquet", "val/b.parquet", "test/c.parquet", "dev_set/d.parquet"],
        ["x/y/testing/a.parquet", "x/training/b.parquet", "x/eval/c.parquet"],
        ["train.parquet", "test.parquet", "cifar10_valid.parquet", "evaluation-2.parquet"],
        ["test/a.parquet", "train-00000.parquet"],  # folder names win over file names
        ["trainval.parquet", "pretrained/a.parquet", "contest.parquet", "latest/b.parquet"],
        [".cache/test.parquet", "__pycache__/test.parquet", "train.parquet"],
    ],
)
def test_split_inference_matches_datasets(tmp_path, layout):
    """The split of each file is the one ``datasets`` itself infers from the names."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    from mura_plugin.datasets import _common as c

    for rel in layout:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"")
    patterns = get_data_patterns(str(tmp_path))
    theirs = {
        str(k): sorted(v) for k, v in DataFilesDict.from_patterns(patterns, str(tmp_path)).items()
    }
    if patterns == {"train": ["**"]}:  # their fallback: nothing is named, all is "train"
        theirs = {}
    ours = c.files_by_split(tmp_path, c.parquet_files(tmp_path))
    assert {k: sorted(str(f) for f in v) for k, v in ours.items()} == theirs


# -- labels must name classes --------------------------------------------------------------
def test_labels_outside_the_class_range_are_errors(tmp_path):
    import pickle

    fx.hf_parquet(tmp_path / "a" / "cifar10" / "test.parquet", [0, 10, -1, 3], image_column="img")
    with pytest.raises(ValueError, match=r"2 of 4 label\(s\) outside 0\.\.9.*row 1: 10.*row 2: -1"):
        factory("cifar10")(data_dir=str(tmp_path / "a"))
    # -1 (the unlabeled hub test split) must not wrap around to ImageNet class 999
    fx.hf_parquet(tmp_path / "b" / "imagenet-1k" / "validation.parquet", [5, -1, -1])
    with pytest.raises(
        ValueError, match=r"2 of 3 label\(s\) outside 0\.\.999.*row 1: -1.*unlabeled"
    ):
        factory("imagenet")(data_dir=str(tmp_path / "b"))
    fx.hf_parquet(tmp_path / "c" / "sketch" / "train.parquet", [1000, 3])
    with pytest.raises(ValueError, match=r"1 of 2 label\(s\) outside 0\.\.999.*row 0: 1000"):
        factory("imagenet_sketch")(data_dir=str(tmp_path / "c"))
    # the published npy layout of CIFAR-10-C
    d = fx.cifar_c(tmp_path / "d", n=2, corruptions=["fog"])
    labels = np.load(d / "labels.npy")
    labels[[3, 7]] = [10, 255]
    np.save(d / "labels.npy", labels)
    with pytest.raises(ValueError, match=r"labels\.npy: 2 of 10 label\(s\).*row 3: 10.*row 7: 255"):
        factory("cifar10_c")(shift="fog", severity=1, data_dir=str(tmp_path / "d"))
    np.save(d / "labels.npy", labels.astype(np.float32))
    with pytest.raises(ValueError, match=r"labels\.npy.*integer.*float32"):
        factory("cifar10_c")(shift="fog", severity=1, data_dir=str(tmp_path / "d"))
    # the python pickle batches
    e = tmp_path / "e" / "cifar-10-batches-py"
    e.mkdir(parents=True)
    with open(e / "test_batch", "wb") as fh:
        pickle.dump({b"data": np.zeros((2, 3072), np.uint8), b"labels": [3, 12]}, fh)
    with pytest.raises(
        ValueError, match=r"test_batch: 1 of 2 label\(s\) outside 0\.\.9.*row 1: 12"
    ):
        factory("cifar10")(data_dir=str(tmp_path / "e"))
    # any local parquet set: labels index the class names given
    fx.hf_parquet(tmp_path / "f" / "x.parquet", [0, 2, 1, 2])
    with pytest.raises(ValueError, match=r"2 of 4 label\(s\) outside 0\.\.1 \(2 classes"):
        factory("parquet")(data_dir=str(tmp_path / "f"), classnames=["x", "y"])


# -- check_args: the cheap pre-setup check the CLI runs --------------------------------------
def test_dataset_check_args_take_the_factory_arguments():
    import inspect

    reg = registry("datasets")
    checked = [n for n in reg.names() if hasattr(reg.get(n), "check_args")]
    assert {"cifar10_c", "cifar100_c", "imagenet_c", "imagefolder", "parquet"} <= set(checked)
    for n in checked:
        ours = inspect.signature(reg.get(n).check_args).parameters
        theirs = inspect.signature(reg.get(n)).parameters
        assert ours.keys() == theirs.keys(), n
        assert all(p.kind == p.KEYWORD_ONLY and p.default is not p.empty for p in ours.values())


def test_dataset_check_args_fail_before_reading(tmp_path):
    check = factory("cifar10_c").check_args
    with pytest.raises(DataUnavailableError, match=r"zenodo.org/records/2535967.*--data-dir"):
        check(shift="fog", severity=5, data_dir=str(tmp_path))
    with pytest.raises(DataUnavailableError, match="no --data-dir given"):
        check(templates="simple")
    d = fx.cifar_c(tmp_path, n=2, corruptions=["fog"])
    (d / "labels.npy").write_bytes(b"not read by the check")
    assert check(shift="fog", severity=5, data_dir=str(tmp_path), templates="simple") is None
    assert check(data_dir=str(tmp_path)) is None  # no domain named: the folder only
    with pytest.raises(DataUnavailableError, match="snow.npy is missing"):
        check(shift="snow", severity=5, data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="unknown corruption 'fgo'"):
        check(shift="fgo", severity=5, data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="unknown template set 'simpel'"):
        check(shift="fog", severity=5, data_dir=str(tmp_path), templates="simpel")
    ic = factory("imagenet_c").check_args
    fx.tree(tmp_path / "imagenet-c" / "fog" / "5", ["n01440764"], per_folder=1, size=(224, 224))
    assert ic(shift="fog", severity=5, data_dir=str(tmp_path), subset=5000) is None
    with pytest.raises(DataUnavailableError, match="imagenet-c/fog/3 is missing"):
        ic(shift="fog", severity=3, data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="multiple of 1000"):
        ic(shift="fog", severity=5, data_dir=str(tmp_path), subset=500)
    with pytest.raises(DataUnavailableError, match="needs --data-dir"):
        factory("imagefolder").check_args()
    with pytest.raises(ValueError, match="1 class names for 2 folders"):
        fx.tree(tmp_path / "folder", ["cat", "dog"], per_folder=1)
        factory("imagefolder").check_args(data_dir=str(tmp_path / "folder"), classnames=["x"])
    (tmp_path / "pq" / "test.parquet").parent.mkdir()
    (tmp_path / "pq" / "test.parquet").write_bytes(b"not read by the check")
    assert factory("parquet").check_args(data_dir=str(tmp_path / "pq"), split="test") is None
    with pytest.raises(DataUnavailableError, match=r"split 'validation'.*identified: test"):
        factory("parquet").check_args(data_dir=str(tmp_path / "pq"), split="validation")


# -- the decoded-image cache ---------------------------------------------------------------
def test_decode_cache_reuse_and_bad_images(tmp_path, tmp_cache):
    files = fx.tree(tmp_path / "f", ["a", "b"], per_folder=3)
    s = factory("imagefolder")(data_dir=str(tmp_path / "f"))
    first = decode(s, 24, workers=2)
    assert not first.from_cache and cache_path(s, 24).exists()
    again = decode(s, 24)
    assert again.from_cache and np.array_equal(np.asarray(again.images), np.asarray(first.images))
    assert not cache_path(s, 32).exists()
    # a truncated JPEG: named by index and path; nothing half-written in the cache
    bad = files[4]
    bad.write_bytes(bad.read_bytes()[:200])
    s2 = factory("imagefolder")(data_dir=str(tmp_path / "f"))
    assert s2.fingerprint != s.fingerprint  # the file changed: a new cache entry
    with pytest.raises(BadImageError, match=r"index 4 \(.*img1.JPEG\)"):
        decode(s2, 24)
    # the entry records the bad image, so a later "skip" run reuses it; whole, no .tmp left
    assert cache_path(s2, 24).exists()
    assert not [p for p in (tmp_cache / "decoded").iterdir() if p.name.endswith(".tmp")]
    skipped = decode(s2, 24, on_bad_image="skip")
    assert skipped.skipped == [4] and skipped.bad[0]["path"].endswith("img1.JPEG")
    assert not np.asarray(skipped.images[4]).any()
    with pytest.raises(BadImageError):  # a cache made under "skip" still fails by default
        decode(s2, 24)
    assert decode(s2, 24, on_bad_image="skip").from_cache


# -- suites through the CLI ----------------------------------------------------------------
def test_suites_pinned():
    from tta_bench.run.protocol import load_protocol

    for name in ("cifar10-c", "cifar100-c", "imagenet-c-5k", "imagenet-c-50k"):
        p = load_protocol(name)
        assert p.shifts == fx.CORRUPTIONS and p.severities == (5,) and p.shift_source == "dataset"
    assert load_protocol("cifar10-c").batch_size == 200
    assert load_protocol("imagenet-c-5k").dataset_args["subset"] == 5000
    assert (
        load_protocol("imagenet-c-5k").batch_size
        == load_protocol("imagenet-c-50k").batch_size
        == 64
    )
    ood = load_protocol("imagenet-ood")
    assert ood.shifts == ("imagenet_a", "imagenet_v2", "imagenet_r", "imagenet_sketch")


def test_cli_cifar10_c_on_fixture_and_missing_data(tmp_path, tmp_cache, monkeypatch):
    from tta_bench.cli import main

    fx.cifar_c(tmp_path / "data", n=4)
    out = tmp_path / "r.json"
    common = [
        "run",
        "--method",
        "zeroshot",
        "--suite",
        "cifar10-c",
        "--model",
        "openclip",
        "--quiet",
    ]
    args = ["model.arch=ViT-S-32", "model.image_size=32", "model.allow_random=true"]
    args += ["device=cpu", "seeds=[0]"]
    rc = main([*common, "--data-dir", str(tmp_path / "data"), "--output", str(out), *args])
    assert rc == 0
    record = json.loads(out.read_text())
    assert [c["shift"] for c in record["cells"]] == list(fx.CORRUPTIONS)
    assert all(c["n"] == 4 and c["severity"] == 5 for c in record["cells"])
    assert record["skipped_images"] == {}
    missing = tmp_path / "missing.json"
    (tmp_path / "empty").mkdir()
    rc = main([*common, "--data-dir", str(tmp_path / "empty"), "--output", str(missing), *args])
    assert rc == 2 and not missing.exists()


def test_cli_real_suite_without_weights_or_data_fails_fast(tmp_path, capsys):
    """``tta-bench run --suite cifar10-c``: no weights, no data: exit 2 and what to pass."""
    from tta_bench.cli import main

    out = tmp_path / "r.json"
    assert main(["run", "--suite", "cifar10-c", "--quiet", "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "model.pretrained=<tag>" in err and "model.allow_random=true" in err
    assert not out.exists()


def test_digits_equal_scikit_learns_loader_and_split():
    """The digits are read without importing scikit-learn's datasets and model selection
    (a second per process): the same values as ``load_digits()``, and the stored split is
    its stratified ``train_test_split``, so the images and labels of both splits are those
    every committed result was computed on."""
    from PIL import Image
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from mura_plugin.datasets import digits as dg

    bunch = load_digits()
    flat, target = dg._load_digits()
    assert np.array_equal(flat, bunch.data) and np.array_equal(target, bunch.target)
    idx = np.arange(len(bunch.target))
    train, test = train_test_split(
        idx, test_size=dg.TEST_FRACTION, stratify=bunch.target, random_state=dg.SPLIT_SEED
    )
    assert dg._split()["test"] == sorted(test.tolist())
    raw = (bunch.images / 16.0 * 255.0).round().clip(0, 255).astype(np.uint8)
    for split, rows in (("train", np.sort(train)), ("test", np.sort(test))):
        images, labels = dg.digits_arrays(split)
        up = np.stack([np.asarray(Image.fromarray(raw[i]).resize((32, 32), Image.BICUBIC))
                       for i in rows])  # fmt: skip
        assert np.array_equal(images, np.repeat(up[..., None], 3, axis=-1))
        assert np.array_equal(labels, bunch.target[rows])
