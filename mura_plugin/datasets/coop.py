"""The ten cross-domain sets of CoOp's splits (Zhou et al., IJCV 2022), the second table of
every VLM test-time adaptation paper (TPT, TDA, TTL, ZERO, TTA-VLM), read from the layout
CoOp's DATASETS.md publishes (github.com/KaiyangZhou/CoOp, read at commit
ff61507c790454bce7c5052c3ac39e60772f1f89: DATASETS.md, datasets/*.py, trainers/zsclip.py;
and TDA's loaders, github.com/kdiAAA/TDA at e697fb0c8078cdeff93daa56bcf8860702542069:
datasets/*.py, which read the same files).

Layout under ``--data-dir`` (folder, image directory, split file: the catalogue's
``local_dirs``, ``image_dir``, ``split_file``):

* ``caltech-101/101_ObjectCategories`` + ``split_zhou_Caltech101.json``;
  ``oxford_pets/images`` + ``split_zhou_OxfordPets.json``; ``stanford_cars/`` (the split's
  paths start with ``cars_train/`` / ``cars_test/``) + ``split_zhou_StanfordCars.json``;
  ``oxford_flowers/jpg`` + ``split_zhou_OxfordFlowers.json``; ``food-101/images`` +
  ``split_zhou_Food101.json``; ``sun397/SUN397`` + ``split_zhou_SUN397.json``;
  ``dtd/images`` + ``split_zhou_DescribableTextures.json``; ``eurosat/2750`` +
  ``split_zhou_EuroSAT.json``; ``ucf101/UCF-101-midframes`` + ``split_zhou_UCF101.json``.
  A split file maps ``train`` / ``val`` / ``test`` to lists of ``[path relative to the image
  directory, label, class name]``; the split's images and labels are read exactly, in the
  file's order (CoOp's ``read_split``);
* ``fgvc_aircraft/`` (the archive's ``data/`` folder): ``variants.txt`` (one class name per
  line; label = line index) and ``images_variant_{train,val,test}.txt`` (``<image id> <class
  name>`` per line; the image is ``images/<id>.jpg``), CoOp's ``FGVCAircraft.read_data``.

Class names are CoOp's, the names its split files hold (the renamed ones included:
Caltech's ``face`` / ``leopard`` / ``motorbike`` / ``airplane``, EuroSAT's ``Annual Crop
Land`` ...; the renaming happened when the split files were made, nothing renames after
reading), in label order, from the catalogue; every row of a split file must name its
label's catalogue class, so a file of another version fails naming the row. As CoOp and TDA
do before formatting a prompt, ``_`` becomes a space (``car_side`` -> ``car side``).
The protocol head (``templates``) is CoOp's template for the set (trainers/zsclip.py:
``CUSTOM_TEMPLATES``), and the catalogue's ``official_templates`` holds TDA's (its 7
ImageNet templates on Caltech101, StanfordCars and SUN397, the CoOp template elsewhere),
which ``text_head=official`` uses.

Missing data raises ``DataUnavailableError``: what to download and where to point
``--data-dir``. ``cross_domain`` and ``vlm_domains`` serve the sets as the domains of one
suite (``shift_source: dataset``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from mura_plugin.datasets import _common as c
from mura_plugin.datasets import _inventory as inv
from tta_bench.data import DataInventory, DataUnavailableError, DomainStream
from tta_bench.text_head import resolve_templates

__all__ = [
    "COOP_SETS",
    "SPLITS",
    "caltech101",
    "oxford_pets",
    "stanford_cars",
    "oxford_flowers",
    "food101",
    "fgvc_aircraft",
    "sun397",
    "dtd",
    "eurosat",
    "ucf101",
    "cross_domain",
    "vlm_domains",
    "read_coop_split",
    "read_aircraft",
]

#: The ten sets in the order of the TDA / TPT cross-domain tables.
COOP_SETS = (
    "fgvc_aircraft",
    "caltech101",
    "stanford_cars",
    "dtd",
    "eurosat",
    "oxford_flowers",
    "food101",
    "oxford_pets",
    "sun397",
    "ucf101",
)
SPLITS = ("train", "val", "test")


def _layout(meta: dict[str, Any]) -> str:
    folder = meta["local_dirs"][0]
    if meta["layout"] == "aircraft_variants":
        return (
            f"{folder}/variants.txt, {folder}/images_variant_<split>.txt, {folder}/images/<id>.jpg"
        )
    image_dir = meta["image_dir"]
    where = folder if image_dir == "." else f"{folder}/{image_dir}"
    return f"{folder}/{meta['split_file']} + the images under {where}/"


def _looks_like(meta: dict[str, Any]) -> Callable[[Path], bool]:
    if meta["layout"] == "aircraft_variants":
        return lambda p: (p / "variants.txt").is_file() and (p / "images").is_dir()
    return lambda p: (p / meta["split_file"]).is_file()


def _root(name: str, meta: dict[str, Any], data_dir: Any) -> Path:
    root = c.find_local(data_dir, meta["local_dirs"], _looks_like(meta))
    if root is None:
        raise DataUnavailableError(
            c.unavailable_message(name, meta, data_dir, _layout(meta), hf_copy=False)
        )
    return root


def _check_split(name: str, split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"{name}: unknown split {split!r}; available: {', '.join(SPLITS)}")


def read_coop_split(
    path: Path, split: str, classnames: Sequence[str], what: str
) -> tuple[list[str], list[int]]:
    """``(relative paths, labels)`` of ``split`` in CoOp split file ``path``, in its order;
    each item must be ``[path, label, class name]`` with the label's catalogue class name."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{what}: cannot read split file {path}: {exc}") from exc
    if not isinstance(data, dict) or split not in data:
        keys = list(data) if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{what}: {path} has no {split!r} list (it has {keys})")
    rels, labels = [], []
    for i, item in enumerate(data[split]):
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[1], int)):
            raise ValueError(
                f"{what}: {path.name} {split}[{i}] is {item!r}, not [path, label, class name]"
            )
        rel, label, cname = item
        if not 0 <= label < len(classnames):
            raise ValueError(
                f"{what}: {path.name} {split}[{i}] has label {label}, outside "
                f"0..{len(classnames) - 1}"
            )
        if cname != classnames[label]:
            raise ValueError(
                f"{what}: {path.name} {split}[{i}] names class {cname!r} for label {label}, "
                f"where CoOp's class list has {classnames[label]!r}: another version of the split?"
            )
        rels.append(str(rel))
        labels.append(label)
    return rels, labels


def read_aircraft(
    root: Path, split: str, classnames: Sequence[str], what: str
) -> tuple[list[str], list[int]]:
    """``(paths relative to images/, labels)`` of FGVC-Aircraft's ``split`` (variants)."""
    variants = [ln.strip() for ln in (root / "variants.txt").read_text().splitlines() if ln.strip()]
    if variants != list(classnames):
        diff = next(
            (i for i, (a, b) in enumerate(zip(variants, classnames)) if a != b),
            min(len(variants), len(classnames)),
        )
        raise ValueError(
            f"{what}: {root / 'variants.txt'} lists {len(variants)} variants that differ from "
            f"the {len(classnames)} of the catalogue from line {diff + 1}"
        )
    listing = root / f"images_variant_{split}.txt"
    if not listing.is_file():
        raise DataUnavailableError(f"{what}: {listing} is missing")
    label_of = {v: i for i, v in enumerate(variants)}
    rels, labels = [], []
    for n, line in enumerate(listing.read_text().splitlines(), start=1):
        parts = line.strip().split(" ")
        if not parts or not parts[0]:
            continue
        cname = " ".join(parts[1:])
        if cname not in label_of:
            raise ValueError(f"{what}: {listing.name} line {n} names unknown variant {cname!r}")
        rels.append(parts[0] + ".jpg")
        labels.append(label_of[cname])
    return rels, labels


def _read_split(
    root: Path, meta: dict[str, Any], split: str, name: str
) -> tuple[Path, list[str], list[int]]:
    """``(split file, image paths relative to the image directory, labels)`` of ``split``."""
    names = list(meta["classnames"])
    if meta["layout"] == "aircraft_variants":
        return root / f"images_variant_{split}.txt", *read_aircraft(root, split, names, name)
    return root / meta["split_file"], *read_coop_split(
        root / meta["split_file"], split, names, name
    )


def _there(file: Path) -> bool:
    # a link that leads to no file is there, but unreadable: a bad image for the run's
    # --on-bad-image policy, not missing data
    return file.is_file() or c.is_broken_link(file)


def _coop(
    name: str, split: str, data_dir: Any, templates: str | Sequence[str] | None
) -> DomainStream:
    _check_split(name, split)
    meta = c.dataset_meta(name)
    root = _root(name, meta, data_dir)
    listing, rels, labels = _read_split(root, meta, split, name)
    image_dir = root / meta["image_dir"]
    files = [image_dir / r for r in rels]
    missing = [f for f in files if not _there(f)]
    if missing:
        raise DataUnavailableError(
            f"{name}: {len(missing)} of the {len(files)} images of its {split} split are missing "
            f"under {image_dir}, e.g. {missing[0]}; "
            + c.unavailable_message(name, meta, data_dir, _layout(meta), hf_copy=False).split(
                ": ", 1
            )[1]
        )
    if not files:
        raise DataUnavailableError(f"{name}: the {split} split of {root} lists no image")
    if split == "test":  # a split file of another version, or an edited one
        c.warn_count(name, listing, len(files), meta.get("test_size"))
    return DomainStream(
        name=name,
        classnames=[n.replace("_", " ") for n in meta["classnames"]],
        templates=resolve_templates(templates or meta["templates"]),
        dataset=c.folder_dataset(files, labels),
        fingerprint=f"{name}/coop/{split}/{c.files_fingerprint(root, files)}",
        metadata={"source": str(root), "split": split, "dataset": name},
    )


def _inventory(name: str) -> Callable[[SimpleNamespace], DataInventory]:
    def inventory(a: SimpleNamespace) -> DataInventory:
        """The split file (its digest, its list against CoOp's published test size) and
        which of the images it lists are there (folders whose listed images are all gone)."""
        _check_split(name, a.split)
        meta = c.dataset_meta(name)
        published = meta.get("test_size") if a.split == "test" else None
        hint = c.download_hint(meta, _layout(meta), hf_copy=False)
        root = c.find_local(a.data_dir, meta["local_dirs"], _looks_like(meta))
        if root is None:
            return inv.not_found(name, published, hint)
        found = DataInventory(name, where=str(root), published=published, download=hint)
        try:
            listing, rels, _ = _read_split(root, meta, a.split, name)
        except (ValueError, OSError) as exc:  # DataUnavailableError is both
            found.problems.append(str(exc))
            return found
        found.split_file = f"{listing.name} {inv.file_digest(listing)}, {len(rels):,} {a.split}"
        image_dir = root / meta["image_dir"]
        gone = [r for r in rels if not _there(image_dir / r)]
        found.images, found.missing_files = len(rels) - len(gone), len(gone)
        gone_set, kept = set(gone), {}  # kept: class folder -> one of its images is there
        for r in rels:
            parts = Path(r).parts
            if len(parts) > 1:
                kept[parts[0]] = kept.get(parts[0], False) or r not in gone_set
        found.empty = sorted(f for f, there in kept.items() if not there)
        if gone:
            found.notes.append(
                f"{len(gone)} of the {len(rels)} images its {a.split} split lists are missing "
                f"under {image_dir}, e.g. {gone[0]}: a run stops on them"
            )
        if published and len(rels) != published:
            found.notes.append(
                f"{listing.name} lists {len(rels):,} {a.split} images; CoOp's published split "
                f"lists {published:,}: another version of the split, or an edited one"
            )
        return found

    return inventory


def _check(name: str) -> Callable[[SimpleNamespace], None]:
    def check(a: SimpleNamespace) -> None:
        """Before any setup: the split name, the templates, and that the set's folder with
        its split file is under ``data_dir`` (no image is listed or read)."""
        _check_split(name, a.split)
        meta = c.dataset_meta(name)
        resolve_templates(a.templates or meta["templates"])
        _root(name, meta, a.data_dir)

    return check


def _factory(name: str, title: str) -> Callable[..., DomainStream]:
    def factory(
        *,
        split: str = "test",
        data_dir: str | None = None,
        templates: str | Sequence[str] | None = None,
    ) -> DomainStream:
        return _coop(name, split, data_dir, templates)

    factory.__name__ = factory.__qualname__ = name
    factory.__doc__ = (
        f"{title} in CoOp's published layout (``split`` train / val / test; see the module)."
    )
    c.attach_check(factory, _check(name))
    c.attach_inventory(factory, _inventory(name))
    return factory


caltech101 = _factory("caltech101", "Caltech-101 (100 classes)")
oxford_pets = _factory("oxford_pets", "Oxford-IIIT Pets (37 classes)")
stanford_cars = _factory("stanford_cars", "Stanford Cars (196 classes)")
oxford_flowers = _factory("oxford_flowers", "Oxford Flowers-102 (102 classes)")
food101 = _factory("food101", "Food-101 (101 classes)")
fgvc_aircraft = _factory("fgvc_aircraft", "FGVC-Aircraft variants (100 classes)")
sun397 = _factory("sun397", "SUN397 (397 classes)")
dtd = _factory("dtd", "Describable Textures (47 classes)")
eurosat = _factory("eurosat", "EuroSAT RGB (10 classes)")
ucf101 = _factory("ucf101", "UCF101 middle frames (101 classes)")


def _domain_factories() -> dict[str, Callable[..., DomainStream]]:
    from mura_plugin.datasets import imagenet

    coop = {n: globals()[n] for n in COOP_SETS}
    family = {
        "imagenet": imagenet.imagenet,
        "imagenet_a": imagenet.imagenet_a,
        "imagenet_v2": imagenet.imagenet_v2,
        "imagenet_r": imagenet.imagenet_r,
        "imagenet_sketch": imagenet.imagenet_sketch,
    }
    return {**family, **coop}


def _domain_factory(suite_dataset: str, shift: str | None, severity: int | None) -> Any:
    """The factory of ``shift``, one of ``suite_dataset``'s catalogue ``domains``; a bad
    domain or a severity other than 1 is a ``ValueError`` listing the options."""
    domains = list(c.dataset_meta(suite_dataset)["domains"])
    if shift not in domains:
        raise ValueError(
            f"{suite_dataset}: unknown domain {shift!r}; available: {', '.join(domains)}"
        )
    if severity not in (1, None):
        raise ValueError(
            f"{suite_dataset}: each dataset is one domain (severity 1), got severity {severity}"
        )
    return _domain_factories()[shift]


def _dispatch(
    suite_dataset: str, shift: str, severity: int, data_dir: Any, templates: Any
) -> DomainStream:
    stream = _domain_factory(suite_dataset, shift, severity)(data_dir=data_dir, templates=templates)
    stream.metadata["dataset"] = shift  # the methods' per-dataset settings read it
    return stream


def cross_domain(
    *,
    shift: str,
    severity: int = 1,
    data_dir: str | None = None,
    templates: str | Sequence[str] | None = None,
) -> DomainStream:
    """One of the ten cross-domain sets (``shift`` = its dataset name, ``COOP_SETS``), its
    test split, for suites with ``shift_source: dataset`` (one level, severity 1)."""
    return _dispatch("cross_domain", shift, severity, data_dir, templates)


def vlm_domains(
    *,
    shift: str,
    severity: int = 1,
    data_dir: str | None = None,
    templates: str | Sequence[str] | None = None,
) -> DomainStream:
    """One of TTA-VLM's fifteen sets: the ImageNet family (ImageNet validation, -A, -V2, -R,
    -Sketch) and the ten cross-domain test splits; ``shift`` = the dataset name."""
    return _dispatch("vlm_domains", shift, severity, data_dir, templates)


def _check_dispatch(suite_dataset: str) -> Callable[[SimpleNamespace], None]:
    def check(a: SimpleNamespace) -> None:
        """Before any setup: the domain is one of the suite dataset's, and that set's own
        cheap check passes (its folder and split file exist)."""
        if a.shift is None:
            return
        checker = getattr(_domain_factory(suite_dataset, a.shift, a.severity), "check_args", None)
        if callable(checker):
            checker(data_dir=a.data_dir, templates=a.templates)

    return check


c.attach_check(cross_domain, _check_dispatch("cross_domain"))
c.attach_check(vlm_domains, _check_dispatch("vlm_domains"))


def _inventory_dispatch(suite_dataset: str) -> Callable[[SimpleNamespace], DataInventory]:
    def inventory(a: SimpleNamespace) -> DataInventory:
        """The inventory of the set ``shift``, one of the suite dataset's domains."""
        factory = _domain_factory(suite_dataset, a.shift, a.severity)
        return factory.inventory(data_dir=a.data_dir)  # type: ignore[attr-defined]

    return inventory


c.attach_inventory(cross_domain, _inventory_dispatch("cross_domain"))
c.attach_inventory(vlm_domains, _inventory_dispatch("vlm_domains"))
