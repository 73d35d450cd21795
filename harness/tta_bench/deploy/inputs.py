"""The images an ``Adapter`` is given (``tta_bench.deploy.adapter``): what it takes (paths,
encoded bytes, PIL images, numpy arrays, float tensors), each checked and named when it is
refused (``ArgumentError`` for a wrong kind, ``ValueError`` for a bad value, NaN and
infinity included; ``ImageTooLargeError`` over the pixel budget, from a file's header
before any pixel is decoded), and decoded as the harness decodes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from tta_bench.deploy.backbone import ArgumentError

__all__ = [
    "array_image",
    "check_max_pixels",
    "decoded_image",
    "image_items",
    "preprocess_images",
    "tensor_batch",
]

_IMAGE_KINDS = (
    "a path, an encoded file's bytes, a PIL image, or a numpy array [H, W, 3] / [H, W] "
    "(uint8, or float on the 0..1 scale)"
)


def check_max_pixels(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"max_pixels must be an integer >= 1, got {value!r}")
    return int(value)


def image_items(images: Any) -> list[tuple[str, Any]]:
    """``(label, image)`` of each image ``preprocess`` was given: one image (labelled
    ``images``), a list or tuple of them (``images[i]``), or a numpy batch
    ``[B, H, W, 3]``; an ``ArgumentError`` for anything else, a ``ValueError`` when empty."""
    from PIL import Image

    if isinstance(images, (Image.Image, str, Path, bytes, bytearray)):
        return [("images", images)]
    if isinstance(images, np.ndarray):
        if images.ndim in (2, 3):
            return [("images", images)]
        if images.ndim == 4 and images.shape[-1] == 3:
            if not len(images):
                raise ValueError("no images to preprocess: the batch array is empty")
            return [(f"images[{i}]", a) for i, a in enumerate(images)]
        raise ValueError(_shape_message("images", images.shape))
    if isinstance(images, torch.Tensor):
        raise ArgumentError(
            "Adapter.preprocess takes images to decode and resize, not a float tensor; pass "
            "float images [B, 3, S, S] in [0, 1] to adapter(images) as they are"
        )
    if not isinstance(images, (list, tuple)):
        raise ArgumentError(
            f"images must be one image or a list of images, each {_IMAGE_KINDS}; got "
            f"{type(images).__name__} {_short(images)}"
        )
    if not images:
        raise ValueError("no images to preprocess: the list is empty")
    items = []
    for i, img in enumerate(images):
        label = f"images[{i}]"
        if img is None:
            raise ArgumentError(f"{label} is None; expected {_IMAGE_KINDS}")
        if not isinstance(img, (Image.Image, str, Path, bytes, bytearray, np.ndarray)):
            kind = type(img).__name__
            article = "an" if kind[:1].lower() in "aeiou" else "a"
            raise ArgumentError(
                f"{label} is {article} {kind} ({_short(img)}); expected {_IMAGE_KINDS}"
            )
        items.append((label, img))
    return items


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _shape_message(label: str, shape: tuple[int, ...]) -> str:
    return (
        f"{label} has shape {tuple(shape)}; expected an image [H, W, 3] (channels last) or "
        "[H, W] (gray), or a batch [B, H, W, 3] (a channels-first [3, H, W] array: "
        "transpose it with .transpose(1, 2, 0))"
    )


def array_image(arr: np.ndarray, label: str) -> Any:
    """A numpy image as ``preprocess`` takes it, as a PIL image: a uint8 array as it is,
    a float one on the 0..1 scale rounded to 8 bits
    (``round(v * 255)``, the rule of float image files). ValueError naming ``label`` for
    another shape or dtype, and for NaN, infinite or out-of-range float values."""
    from PIL import Image

    if arr.ndim not in (2, 3) or (arr.ndim == 3 and arr.shape[-1] != 3):
        raise ValueError(_shape_message(label, arr.shape))
    if 0 in arr.shape:
        raise ValueError(f"{label} has shape {tuple(arr.shape)}: no pixels to classify")
    if arr.dtype.kind == "f":
        nans = int(np.isnan(arr).sum())
        infs = int(np.isinf(arr).sum())
        if nans or infs:
            what = f"{nans} NaN" if nans else f"{infs} infinite"
            raise ValueError(
                f"{label} has {what} value(s) of {arr.size}; expected a float image on the "
                "0..1 scale (NaN is refused as infinity is)"
            )
        lo, hi = float(arr.min()), float(arr.max())
        if lo < 0.0 or hi > 1.0:
            raise ValueError(
                f"{label} has dtype {arr.dtype}: a float image must be on the 0..1 scale, got "
                f"values in [{lo:.6g}, {hi:.6g}]; divide 8-bit values by 255"
            )
        arr = np.rint(arr.astype(np.float64) * 255.0).astype(np.uint8)
    elif arr.dtype != np.uint8:
        raise ValueError(
            f"{label} has dtype {arr.dtype}; expected uint8 or float on the 0..1 scale (a "
            "16-bit image: save it as a file, which is decoded by the harness's rules)"
        )
    return Image.fromarray(np.ascontiguousarray(arr), "RGB" if arr.ndim == 3 else "L")


def decoded_image(img: Any, label: str, budget: int, size: int, where: str) -> Any:
    """One image of ``Adapter.preprocess``, decoded to 8-bit RGB (a PIL image, or a uint8
    array already at the model's size ``size``), its size checked against ``budget`` (the
    limit named ``where`` in messages) before decoding and after the resize it will get."""
    from PIL import Image

    from tta_bench.run.cache import resized_size
    from tta_bench.run.images import ImageTooLargeError, decode_rgb

    if isinstance(img, np.ndarray):
        if img.dtype == np.uint8 and img.shape == (size, size, 3):
            return img  # 8-bit RGB at the model's size: nothing to decode or resize
        img = array_image(img, label)
    name = label
    if isinstance(img, (str, Path)):
        name = str(img)
    elif isinstance(img, Image.Image) and isinstance(getattr(img, "filename", None), str):
        name = img.filename or label
    img = decode_rgb(img, name=name, max_pixels=budget, budget_name=where)
    width, height = img.size
    rw, rh = resized_size(width, height, size)
    if rw * rh > budget:
        raise ImageTooLargeError(
            f"image {name!r} is {width}x{height}: resizing its shorter side to the "
            f"model's {size} makes {rw}x{rh} = {rw * rh} pixels; the limit is {budget} "
            f"pixels per image ({where}); crop it to a less elongated shape",
            name,
            width=width,
            height=height,
            pixels=width * height,
            max_pixels=budget,
        )
    return img


def tensor_batch(images: torch.Tensor, size: int) -> torch.Tensor:
    """Float images ``[B, 3, size, size]`` (or one ``[3, size, size]``) in [0, 1], checked:
    shape, dtype, at least one image, no NaN and nothing outside [0, 1] (a ``ValueError``
    saying which)."""
    x = images.unsqueeze(0) if images.dim() == 3 else images
    if x.dim() != 4 or x.shape[1] != 3 or tuple(x.shape[-2:]) != (size, size):
        raise ValueError(
            f"expected float images [B, 3, {size}, {size}] in [0, 1], got shape "
            f"{tuple(images.shape)}; Adapter.preprocess(...) resizes PIL images or paths"
        )
    if not x.is_floating_point():
        raise ValueError(
            f"expected float images in [0, 1], got dtype {x.dtype}; divide uint8 by 255"
        )
    if not x.numel():
        raise ValueError(f"expected at least one image, got shape {tuple(images.shape)}")
    nans = int(torch.isnan(x).sum())
    if nans:
        raise ValueError(
            f"expected images in [0, 1] (the classifier normalises them itself), got "
            f"{nans} NaN value(s) of {x.numel()}; NaN is refused as infinity is"
        )
    if float(x.min()) < 0.0 or float(x.max()) > 1.0:
        raise ValueError(
            f"expected images in [0, 1] (the classifier normalises them itself), got values "
            f"in [{float(x.min()):.3g}, {float(x.max()):.3g}]"
        )
    return x


def preprocess_images(
    images: Any, size: int, device: Any, budget: int, where: str = "max_pixels"
) -> torch.Tensor:
    """``Adapter.preprocess``: what ``image_items`` accepts, each image decoded and checked
    (``decoded_image``), resized on its shorter side to ``size`` and centre-cropped, as
    float ``[B, 3, size, size]`` in [0, 1] on ``device``."""
    from tta_bench.run.cache import to_rgb_array

    arrays = [
        to_rgb_array(decoded_image(img, label, budget, size, where), size)
        for label, img in image_items(images)
    ]
    batch = torch.from_numpy(np.stack(arrays)).to(device)
    return batch.permute(0, 3, 1, 2).float().div_(255.0).contiguous()
