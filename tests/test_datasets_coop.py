"""The ten cross-domain sets in CoOp's published layout: each set's folder, image directory
and split file (FGVC-Aircraft: variants.txt + images_variant_<split>.txt) built as a small
fixture, loaded with exactly the split's images, labels and class names in the file's
order; the suites over them; the methods' per-dataset settings."""

from __future__ import annotations

import json
import os

import fixtures_data as fx
import pytest

from mura_plugin.datasets.coop import COOP_SETS
from tta_bench.catalog import entry
from tta_bench.data import DataUnavailableError
from tta_bench.registry import registry

LABELS = (0, 5, 3, 5)  # unsorted, a label twice: the split's order must be kept


def factory(name):
    return registry("datasets").get(name)


def _paths(stream):
    import datasets

    raw = stream.dataset.cast_column("image", datasets.Image(decode=False))["image"]
    return [p["path"] for p in raw]


@pytest.mark.parametrize("name", COOP_SETS)
def test_loads_exactly_the_published_split(tmp_path, name):
    info = fx.coop_layout(tmp_path, name, LABELS)
    meta = entry("datasets", name)
    stream = factory(name)(data_dir=str(tmp_path))
    assert stream.labels.tolist() == list(LABELS)
    want = [os.path.join(info["image_dir"].resolve(), rel) for rel, _, _ in info["test"]]
    assert [os.path.normpath(p) for p in _paths(stream)] == [os.path.normpath(p) for p in want]
    # CoOp's class names in label order, "_" as a space (as CoOp and TDA format prompts)
    assert stream.classnames == [n.replace("_", " ") for n in meta["classnames"]]
    assert len(stream.classnames) == {"caltech101": 100, "oxford_pets": 37, "stanford_cars": 196,
        "oxford_flowers": 102, "food101": 101, "fgvc_aircraft": 100, "sun397": 397, "dtd": 47,
        "eurosat": 10, "ucf101": 101}[name]  # fmt: skip
    assert stream.templates == list(meta["templates"]) and stream.metadata["dataset"] == name
    for split in ("train", "val"):
        assert len(factory(name)(split=split, data_dir=str(tmp_path))) == 1
    # the set's own folder works as --data-dir too
    assert factory(name)(data_dir=str(info["folder"])).labels.tolist() == list(LABELS)


def test_renamed_class_names_and_templates():
    """CoOp's renamed names (made when its split files were written) and its templates."""
    caltech = entry("datasets", "caltech101")["classnames"]
    assert caltech[:5] == ["face", "leopard", "motorbike", "accordion", "airplane"]
    assert "BACKGROUND_Google" not in caltech and "Faces_easy" not in caltech
    assert entry("datasets", "eurosat")["classnames"][:4] == [
        "Annual Crop Land", "Forest", "Herbaceous Vegetation Land", "Highway or Road"]  # fmt: skip
    assert entry("datasets", "stanford_cars")["classnames"][0] == "2000 AM General Hummer SUV"
    assert entry("datasets", "sun397")["classnames"][8] == "outdoor apartment_building"
    want = {
        "oxford_pets": "a photo of a {}, a type of pet.",
        "oxford_flowers": "a photo of a {}, a type of flower.",
        "fgvc_aircraft": "a photo of a {}, a type of aircraft.",
        "dtd": "{} texture.",
        "eurosat": "a centered satellite photo of {}.",
        "stanford_cars": "a photo of a {}.",
        "food101": "a photo of {}, a type of food.",
        "sun397": "a photo of a {}.",
        "caltech101": "a photo of a {}.",
        "ucf101": "a photo of a person doing {}.",
    }
    assert {n: entry("datasets", n)["templates"] for n in COOP_SETS} == {
        n: [t] for n, t in want.items()
    }
    for name in COOP_SETS:
        assert entry("datasets", name)["fine_grained"] is True


def test_missing_data_says_what_to_download(tmp_path):
    with pytest.raises(DataUnavailableError) as exc:
        factory("food101")(data_dir=str(tmp_path))
    msg = str(exc.value)
    assert "food-101.tar.gz" in msg and "split_zhou_Food101.json" in msg
    assert "<data-dir>/food-101" in msg and "--data-dir" in msg
    with pytest.raises(DataUnavailableError, match="no --data-dir given"):
        factory("dtd")()
    with pytest.raises(DataUnavailableError, match="variants.txt"):
        factory("fgvc_aircraft")(data_dir=str(tmp_path))


def test_a_split_of_another_version_fails_naming_the_row(tmp_path):
    info = fx.coop_layout(tmp_path, "dtd", LABELS)
    split_file = info["folder"] / "split_zhou_DescribableTextures.json"
    data = json.loads(split_file.read_text())
    data["test"][2][2] = "stripy"
    split_file.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"test\[2\] names class 'stripy' for label 3"):
        factory("dtd")(data_dir=str(tmp_path))
    data["test"][2] = ["x.jpg", 3]
    split_file.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="not \\[path, label, class name\\]"):
        factory("dtd")(data_dir=str(tmp_path))


def test_missing_images_and_bad_split_names(tmp_path):
    info = fx.coop_layout(tmp_path, "eurosat", LABELS)
    rel = info["test"][1][0]
    (info["image_dir"] / rel).unlink()
    with pytest.raises(DataUnavailableError, match="1 of the 4 images of its test split"):
        factory("eurosat")(data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="unknown split 'validation'; available: train, val"):
        factory("eurosat")(split="validation", data_dir=str(tmp_path))


def test_broken_image_links_of_a_split_follow_the_bad_image_policy(tmp_path, tmp_cache):
    """An image the split lists that is a dangling link or a link loop is there but
    unreadable: a bad image (skipped and reported under ``skip``, an error naming it under
    ``fail``), not missing data; a file that is not there at all stays missing data (an
    emptied class folder refuses the set, naming what to download)."""
    from tta_bench.data import BadImageError
    from tta_bench.run.cache import decode

    info = fx.coop_layout(tmp_path, "eurosat", LABELS)
    dangling = info["image_dir"] / info["test"][1][0]
    loop = info["image_dir"] / info["test"][2][0]
    dangling.unlink()
    dangling.symlink_to("nowhere.jpg")
    loop.unlink()
    loop.symlink_to(loop.name)
    stream = factory("eurosat")(data_dir=str(tmp_path))
    assert len(stream) == 4
    skipped = decode(stream, 24, on_bad_image="skip")
    assert [(b["index"], os.path.basename(b["path"])) for b in skipped.bad] == [
        (1, dangling.name), (2, loop.name)
    ]  # fmt: skip
    with pytest.raises(BadImageError, match=loop.name):
        decode(stream, 24)
    cname = info["test"][0][0].split("/")[0]
    for f in (info["image_dir"] / cname).iterdir():  # an emptied class folder
        f.unlink()
    with pytest.raises(DataUnavailableError, match="of the 4 images of its test split"):
        factory("eurosat")(data_dir=str(tmp_path))


def test_aircraft_variants_must_match(tmp_path):
    info = fx.coop_layout(tmp_path, "fgvc_aircraft", LABELS)
    variants = info["folder"] / "variants.txt"
    lines = variants.read_text().splitlines()
    variants.write_text("\n".join(lines[:50] + lines[51:]) + "\n")
    with pytest.raises(ValueError, match="differ from the 100 of the catalogue from line 51"):
        factory("fgvc_aircraft")(data_dir=str(tmp_path))


def test_cross_domain_dispatch_and_checks(tmp_path):
    fx.coop_layout(tmp_path, "ucf101", LABELS)
    stream = factory("cross_domain")(shift="ucf101", data_dir=str(tmp_path))
    assert stream.metadata["dataset"] == "ucf101" and stream.classnames[0] == "Apply Eye Makeup"
    with pytest.raises(ValueError, match="unknown domain 'imagenet'; available: fgvc_aircraft"):
        factory("cross_domain")(shift="imagenet", data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="severity 1"):
        factory("cross_domain")(shift="ucf101", severity=2, data_dir=str(tmp_path))
    check = factory("cross_domain").check_args
    check(shift="ucf101", severity=1, data_dir=str(tmp_path))
    with pytest.raises(DataUnavailableError, match="split_zhou_DescribableTextures.json"):
        check(shift="dtd", severity=1, data_dir=str(tmp_path))
    assert factory("vlm_domains")(shift="ucf101", data_dir=str(tmp_path)).metadata["dataset"]


def test_imagenet_ood_domains_name_their_dataset(tmp_path):
    """ImageNet-V2's stream is named for its variant: the dispatcher must name the dataset,
    or the methods' per-dataset settings would fall back to ImageNet's (the bug)."""
    fx.tree(tmp_path / "imagenetv2-matched-frequency-format-val", ["0", "2"], per_folder=1)
    stream = factory("imagenet_ood")(shift="imagenet_v2", data_dir=str(tmp_path))
    assert stream.name != "imagenet_v2" and stream.metadata["dataset"] == "imagenet_v2"


def test_suites_pin_the_tables():
    from tta_bench.run.protocol import load_protocol

    xd = load_protocol("cross-domain-10")
    assert xd.shifts == COOP_SETS and xd.severities == (1,) and xd.shift_source == "dataset"
    assert xd.templates is None  # each set's own CoOp template
    v15 = load_protocol("vlm-15")
    assert v15.shifts[:5] == ("imagenet", "imagenet_a", "imagenet_v2", "imagenet_r",
                              "imagenet_sketch") and v15.shifts[5:] == COOP_SETS  # fmt: skip
    assert v15.templates == ("a photo of a {}.",)


def test_methods_take_the_official_per_dataset_settings():
    from mura_plugin.methods import boostadapter, ctpt, dpe, tda

    assert tda.POSITIVE["caltech101"] == (5.0, 5.0) and tda.POSITIVE["eurosat"] == (4.0, 8.0)
    assert tda.official_templates("sun397") == list(tda.IMAGENET_7)
    assert tda.official_templates("dtd") == ["{} texture."]
    assert not tda.uses_views("official", "food101")  # CLIP's preprocess: the image alone
    assert boostadapter.OFFICIAL["food101"] == (1.0, 1.0, 3)
    assert boostadapter.official_input("caltech101") == "original"
    assert dpe.SETTINGS["fgvc_aircraft"] == (6.0, 2.0, 6e-4, 6e-4, 0.2)
    assert dpe.dpe_templates("stanford_cars")[1].startswith("A {} featuring")
    assert dpe.dpe_templates("caltech101") == list(tda.IMAGENET_7)
    for name in COOP_SETS:
        assert ctpt.dataset_setting(name) == (50.0, True), name  # the fine-grained script
        assert name in tda.POSITIVE and name in boostadapter.OFFICIAL and name in dpe.SETTINGS


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:tiny-clip-digits was pretrained on the digits prompts")
def test_cli_cross_domain_10_end_to_end(tmp_path, tmp_cache, capsys):
    """``tta-bench run --suite cross-domain-10 --data-dir D`` on the ten fixtures, a cell per
    set in the table's order; missing data exits 2 before anything is written. The shipped
    tiny model reads the data path as an open_clip tower would (a random ViT-S-32 spent
    most of this test encoding the ten sets' 1,191 class prompts; the real architectures
    run in tests/test_model_families.py)."""
    from tta_bench.cli import main

    for name in COOP_SETS:
        fx.coop_layout(tmp_path / "data", name, LABELS)
    out = tmp_path / "xd.json"
    args = ["run", "--method", "tda", "--suite", "cross-domain-10", "--model", "tiny-clip-digits",
            "--data-dir", str(tmp_path / "data"), "--quiet", "--output", str(out),
            "device=cpu", "seeds=[0]"]  # fmt: skip
    assert main(args) == 0
    record = json.loads(out.read_text())
    assert [c["shift"] for c in record["cells"]] == list(COOP_SETS)
    assert all(c["n"] == len(LABELS) for c in record["cells"])
    missing = tmp_path / "empty"
    missing.mkdir()
    args[args.index(str(tmp_path / "data"))] = str(missing)
    args[args.index(str(out))] = str(tmp_path / "never.json")
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "the data of 10 of the suite's 10 domains is missing" in err  # all, in one message
    assert all(f"  - {name}: no local copy found" in err for name in COOP_SETS)
    assert not (tmp_path / "never.json").exists()


def test_validate_checks_a_dispatcher_on_its_first_domain(tmp_path):
    """``tta-bench validate dataset cross_domain`` builds its first domain (it must be given a
    shift), instead of failing on the missing argument."""
    from tta_bench.cli.validate import validate

    fx.coop_layout(tmp_path, "fgvc_aircraft", LABELS)
    report = validate("dataset", "cross_domain", data_dir=str(tmp_path))
    assert report.ok and report.counts() == {"PASS": 9, "FAIL": 0, "SKIP": 0}, report.text()


@pytest.mark.parametrize("method", ["tpt", "tps", "rtpt", "rlcf", "dynaprompt"])
def test_tpt_family_takes_its_official_augmix_rule_per_dataset(tmp_path, method):
    """TPT's ``augmix=len(set_id) > 1`` and the codes built on it: AugMix on a fine-grained
    domain, not on digits, where the run key of the committed results stays as it was."""
    from tta_bench.run.resolve import resolve_run
    from tta_bench.run.results import load_results
    from tta_bench.run.resume import spec_key

    fx.coop_layout(tmp_path, "dtd", LABELS)
    fx.tree(tmp_path / "imagenet-r", entry("datasets", "imagenet_r")["wnids"][:2], per_folder=1)
    model = ["model.arch=ViT-S-32", "model.image_size=32", "model.allow_random=true"]
    data = str(tmp_path)
    _, one = resolve_run(method, "cross-domain-10", "openclip", ["protocol.shifts=[dtd]", *model],
                         data_dir=data)  # fmt: skip
    assert one.method_config.augmix is True and one.method_configs is None
    assert one.config["method"]["augmix"] is True  # the record says what ran
    assert one.config["per_dataset_applied"] == {"method.augmix": True}
    shifts = "protocol.shifts=[imagenet_r,dtd]"
    _, two = resolve_run(method, "vlm-15", "openclip", [shifts, *model], data_dir=data)
    assert two.method_config.augmix is False
    assert {d: c.augmix for d, c in two.method_configs.items()} == {"dtd": True}
    _, digits = resolve_run(method, "digits-c")
    assert digits.method_config.augmix is False and digits.method_configs is None
    committed = load_results(f"results/digits-c/{method}.json")
    assert spec_key(digits)["method_config_hash"] == committed["method_config_hash"]
