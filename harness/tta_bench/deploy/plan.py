"""The batches of a ``tta-bench predict`` job (``plan_batches``): which image files of
``input_dir`` go into which batch, in order, for its layout (``folder``, ``subfolders``,
``classes`` or ``auto``, see ``tta_bench.deploy.predict``), and which files are left out and
why. Reads the folder's listing only, never an image."""

from __future__ import annotations

import errno
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["IMAGE_EXTENSIONS", "NOT_AN_IMAGE", "Plan", "PlannedBatch", "plan_batches"]

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
NOT_AN_IMAGE = "not an image file (by its extension)"


@dataclass
class PlannedBatch:
    name: str
    folder: str  # relative to input_dir ("." for the folder layout)
    files: list[str]  # posix paths relative to input_dir
    labels: list[int] | None  # class indices (classes layout), never shown to the method


@dataclass
class Plan:
    layout: str
    batches: list[PlannedBatch]
    labeled: bool
    ignored: list[str]  # files that are not images, or outside the chosen layout
    #: Why each ignored file is ignored (not an image, a dangling symlink, ...).
    reasons: dict[str, str] = field(default_factory=dict)

    def groups(self, reset: str) -> list[list[PlannedBatch]]:
        """Batches that share adaptation state, in order (see the module docstring)."""
        if reset == "per_batch":
            return [[b] for b in self.batches]
        if reset == "never":
            return [list(self.batches)] if self.batches else []
        out: dict[str, list[PlannedBatch]] = {}
        for b in self.batches:
            out.setdefault(b.folder, []).append(b)
        return list(out.values())


def _is_image(p: Path) -> bool:
    return p.suffix.lower() in IMAGE_EXTENSIONS


def _visible_files(
    folder: Path, recursive: bool, unusable: dict[Path, str] | None = None
) -> list[Path]:
    """The files below ``folder`` (hidden ones left out), sorted. Entries that are neither
    a file nor a folder (a dangling or looping symlink, a device, a pipe) are added to
    ``unusable`` with the reason, instead of vanishing."""
    items = folder.rglob("*") if recursive else folder.iterdir()
    out = []
    for p in items:
        rel = p.relative_to(folder)
        if any(part.startswith(".") for part in rel.parts):
            continue
        if p.is_file():
            out.append(p)
        elif not p.is_dir() and unusable is not None:
            unusable[p] = _why_unusable(p)
    return sorted(out)


def _why_unusable(p: Path) -> str:
    """Why ``p`` (neither a file nor a folder) cannot be read as an image."""
    try:
        p.stat()
    except OSError as exc:
        if not p.is_symlink():
            return f"cannot be read: {exc.strerror or exc}"
        target = os.readlink(p)
        if exc.errno == errno.ELOOP:
            return f"symlink loop: its target {target!r} leads back to it"
        return f"dangling symlink: its target {target!r} does not exist"
    return "not a regular file (a device, pipe or socket)"


def _safe_name(name: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "-_." else "_" for c in name).strip(".")
    return cleaned or "batch"


def plan_batches(
    input_dir: str | Path,
    layout: str,
    batch_size: int,
    classnames: list[str],
    *,
    shuffle: bool = False,
    seed: int = 0,
    reset: str = "per_batch",
) -> Plan:
    """The job's batches in order; raises ``ValueError`` for an ambiguous or empty folder."""
    root = Path(input_dir)
    unusable: dict[Path, str] = {}
    top = _visible_files(root, recursive=False, unusable=unusable)
    top_images = [p for p in top if _is_image(p)]
    subdirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    image_dirs = [d for d in subdirs if any(_is_image(p) for p in _visible_files(d, True))]
    if layout == "auto":
        layout = _detect_layout(root, top_images, image_dirs, classnames)
    if layout == "classes" and reset == "per_folder":
        raise ValueError(
            "reset=per_folder resets at folder boundaries, which in the classes layout are "
            "class (label) boundaries: the method would learn the labels from the resets; "
            "use reset=per_batch or never"
        )
    reasons = {_rel(root, p): NOT_AN_IMAGE for p in top if not _is_image(p)}
    if layout == "folder":
        reasons.update({_rel(root, d) + "/": "a subfolder (layout folder)" for d in image_dirs})
        batches = _plan_folder(root, top_images, batch_size, shuffle, seed)
    else:
        reasons.update({_rel(root, p): f"a top-level image (layout {layout})" for p in top_images})
        files = _folder_files(root, image_dirs, classnames, layout, reasons, unusable)
        if layout == "classes":
            batches = _plan_classes(files, batch_size, shuffle, seed)
        else:
            batches = _plan_subfolders(image_dirs, files, batch_size, shuffle, seed)
    reasons.update({_rel(root, p): why for p, why in unusable.items()})
    if not batches:
        raise ValueError(
            f"no images ({', '.join(IMAGE_EXTENSIONS)}) found in {str(root)!r} for layout {layout}"
        )
    ignored = sorted(reasons)
    return Plan(layout, batches, layout == "classes", ignored, {k: reasons[k] for k in ignored})


def _rel(root: Path, p: Path) -> str:
    return p.relative_to(root).as_posix()


def _plan_folder(
    root: Path, images: list[Path], batch_size: int, shuffle: bool, seed: int
) -> list[PlannedBatch]:
    """``folder``: the top-level images cut into ``batch-00000``, ..."""
    files = [_rel(root, p) for p in images]
    if shuffle:
        random.Random(seed).shuffle(files)
    return [
        PlannedBatch(f"batch-{i // batch_size:05d}", ".", files[i : i + batch_size], None)
        for i in range(0, len(files), batch_size)
    ]


def _folder_files(
    root: Path,
    image_dirs: list[Path],
    classnames: list[str],
    layout: str,
    reasons: dict[str, str],
    unusable: dict[Path, str],
) -> list[tuple[str, int | None, str]]:
    """``(file, label or None, folder)`` of every image below the subfolders (non-images
    are added to ``reasons``, unreadable entries to ``unusable``); in the classes layout
    every subfolder must be a class."""
    if layout == "classes":
        unknown = [d.name for d in image_dirs if d.name not in classnames]
        if unknown:
            raise ValueError(
                f"layout classes: subfolder(s) {unknown} of {str(root)!r} are not class "
                f"names; the classes are: {', '.join(classnames)}"
            )
    out: list[tuple[str, int | None, str]] = []
    for d in image_dirs:
        files = _visible_files(d, recursive=True, unusable=unusable)
        reasons.update({_rel(root, p): NOT_AN_IMAGE for p in files if not _is_image(p)})
        label = classnames.index(d.name) if layout == "classes" else None
        out += [(_rel(root, p), label, d.name) for p in files if _is_image(p)]
    return out


def _plan_classes(
    files: list[tuple[str, int | None, str]], batch_size: int, shuffle: bool, seed: int
) -> list[PlannedBatch]:
    """``classes``: all labeled images (sorted, or shuffled by ``seed``) cut into batches."""
    if shuffle:
        random.Random(seed).shuffle(files)
    batches = []
    for i in range(0, len(files), batch_size):
        chunk = files[i : i + batch_size]
        labels = [int(lab) for _, lab, _ in chunk]  # type: ignore[arg-type]
        batches.append(
            PlannedBatch(f"batch-{i // batch_size:05d}", ".", [f for f, _, _ in chunk], labels)
        )
    return batches


def _plan_subfolders(
    image_dirs: list[Path],
    files: list[tuple[str, int | None, str]],
    batch_size: int,
    shuffle: bool,
    seed: int,
) -> list[PlannedBatch]:
    """``subfolders``: each subfolder a batch (cut into ``<name>-00000``, ... when larger)."""
    names: set[str] = set()
    batches = []
    for d in image_dirs:
        mine = [f for f, _, folder in files if folder == d.name]
        if shuffle:
            random.Random(f"{seed}/{d.name}").shuffle(mine)
        base = _safe_name(d.name)
        if base in names:  # two folder names that clean to the same file name
            base = f"{base}-{len(names)}"
        names.add(base)
        chunks = [mine[i : i + batch_size] for i in range(0, len(mine), batch_size)]
        for j, chunk in enumerate(chunks):
            name = base if len(chunks) == 1 else f"{base}-{j:05d}"
            batches.append(PlannedBatch(name, d.name, chunk, None))
    return batches


def _detect_layout(
    root: Path, top_images: list[Path], image_dirs: list[Path], classnames: list[str]
) -> str:
    if top_images and image_dirs:
        raise ValueError(
            f"{str(root)!r} holds images ({len(top_images)}) and image subfolders "
            f"({', '.join(d.name for d in image_dirs[:5])}): set layout to folder (the top-level "
            "images), subfolders or classes"
        )
    if top_images:
        return "folder"
    if not image_dirs:
        raise ValueError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) found in {str(root)!r}")
    named = [d.name for d in image_dirs if d.name in classnames]
    if len(named) == len(image_dirs):
        return "classes"
    if not named:
        return "subfolders"
    others = [d.name for d in image_dirs if d.name not in classnames]
    raise ValueError(
        f"ambiguous layout of {str(root)!r}: subfolders {named[:5]} are class names but "
        f"{others[:5]} are not; set layout to classes (all must be class names) or subfolders"
    )
