"""Decode an image into the 8-bit RGB pixels the models see: the one decoding function of
every path that reads images (the benchmark's decoded cache and streaming decode, the
``predict`` batch job, ``Adapter.preprocess``, the HTTP service), and the header check
that pixel budgets use.

``decode_rgb(source)`` gives, for any image PIL reads, the same 8-bit RGB an equivalent
8-bit file would give:

* ``RGB``: as stored. ``L``: the gray value in every channel. ``1`` (bilevel): 0 or 255.
  ``P`` (palette): the palette's colours. ``CMYK`` (and ``YCbCr``, ``HSV``): PIL's
  conversion (for CMYK the plain formula ``(255 - K) * (1 - C / 255)``; an embedded ICC
  profile is not applied). Other modes PIL cannot convert are refused.
* 16-bit grayscale (``I;16``, ``I;16B``, ``I;16L``, ``I;16N``): the high byte, ``v >> 8``.
  Why not rounding ``v * 255 / 65535``: PIL itself reduces every other 16-bit PNG (gray
  with alpha, RGB, RGBA) to its high byte, so a 16-bit gray file then decodes exactly like
  the same content stored as 16-bit RGB (tested); and both common ways of widening 8-bit
  data to 16 bits (``v * 257`` and ``v << 8``) come back to ``v`` exactly (rounding turns
  ``255 << 8`` into 254). Any 16-bit value is within one level of the rounded scaling.
* ``I`` (32-bit signed integer): how PIL represents 16-bit samples from several formats
  (16-bit PGM, some TIFFs, older Pillow's 16-bit PNG), so values are read on the 16-bit
  scale, ``v >> 8``; an image with a value outside 0..65535 has no agreed 8-bit meaning
  (its bit depth is unknown) and is refused (``UnsupportedImageError``), never clipped.
* ``F`` (32-bit float): the 0..1 scale of floating-point TIFFs and float image arrays,
  ``round(v * 255)``; a value that does not round into 0..255, or NaN/infinity, is refused
  (a float image on the 0..255 scale would otherwise turn white).
* Transparency (``RGBA``, ``LA``, ``PA``, premultiplied ``RGBa``/``La``, a palette or
  colour-key ``transparency``): composited over white, ``c * a + 255 * (1 - a)``, which is
  the 8-bit RGB copy an image editor or browser gives when it flattens the file onto its
  default white page. White rather than black because transparent pixels are the
  picture's background (logos, product shots, drawings, scans): over black a dark drawing
  would vanish, and a fully transparent image becomes the blank page it looks like. Full
  alpha changes nothing: an opaque ``RGBA``/``LA`` file decodes exactly as its RGB/L copy.
* EXIF orientation (tags 2..8, JPEG or any format carrying EXIF): applied first
  (``PIL.ImageOps.exif_transpose``), so the pixels are upright as a viewer shows them;
  the result carries no orientation any more, so decoding it again changes nothing. An
  EXIF block PIL cannot parse is ignored, as viewers ignore it.

Only the first frame of an animated or multi-page file is decoded.

Errors are ``ImageDecodeError`` (a ``ValueError``) subclasses naming the file:
``NotAnImageError`` (no format PIL reads, or not one of ``formats``),
``ImageTooLargeError`` (over ``max_pixels``, from the header, before any pixel is decoded),
``UnreadableImageError`` (the file cannot be read), ``CorruptImageError`` (the header
parses but the pixels cannot be decoded: truncated or corrupt) and
``UnsupportedImageError`` (read, but no 8-bit meaning by the rules above). The first,
third and fourth are ``OSError`` too, as PIL's own errors for those cases are. No other
exception type leaves ``decode_rgb`` or ``read_header`` for any input bytes (tested with
Hypothesis).

``read_header(source)`` reads only the header (``Image.open`` is lazy): the size and
hence the pixel count, for a budget checked before decoding.
"""

from __future__ import annotations

import errno
import io
import os
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any, Union

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

__all__ = [
    "DECODE_VERSION",
    "BACKGROUND",
    "ImageSource",
    "ImageHeader",
    "ImageDecodeError",
    "NotAnImageError",
    "ImageTooLargeError",
    "UnreadableImageError",
    "CorruptImageError",
    "UnsupportedImageError",
    "decode_rgb",
    "read_header",
    "is_plain_jpeg",
]

#: The decoding rules' version: part of the decoded cache's key; bump it whenever a rule
#: changes the pixels any file decodes to.
DECODE_VERSION = "rgb8/v2"
#: What transparent pixels are composited over (see the module docstring).
BACKGROUND = (255, 255, 255)
#: A file path, the file's bytes, an open binary file, or an image PIL has opened.
ImageSource = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview, IO[bytes], Image.Image]

_SIXTEEN_BIT = ("I;16", "I;16B", "I;16L", "I;16N")
_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")
_ORIENTATION = 0x0112
#: EXIF orientations that move pixels (1 is upright; other values are invalid, ignored).
_ROTATIONS = (2, 3, 4, 5, 6, 7, 8)
_IN_MEMORY = "<in-memory image>"
#: Where PIL keeps what ``getexif()`` reads an orientation from (and a TIFF's ``tag_v2``).
_EXIF_KEYS = ("exif", "Raw profile type exif", "xmp", "XML:com.adobe.xmp")


class ImageDecodeError(ValueError):
    """An image that cannot be decoded into 8-bit RGB; ``name`` is the file (or the name
    the caller gave). A ``ValueError``: bad input, never a bug of the caller's."""

    def __init__(self, message: str, name: str = _IN_MEMORY):
        super().__init__(message)
        self.name = name


class NotAnImageError(ImageDecodeError, OSError):
    """No format PIL reads (or none of the accepted ``formats``) recognises the data."""


class ImageTooLargeError(ImageDecodeError):
    """The header says the image has more pixels than the budget allows (nothing was
    decoded). ``width``/``height`` are None when PIL refused the header itself (beyond
    ``2 * PIL.Image.MAX_IMAGE_PIXELS``), where only ``pixels`` is known."""

    def __init__(
        self,
        message: str,
        name: str = _IN_MEMORY,
        *,
        width: int | None = None,
        height: int | None = None,
        pixels: int | None = None,
        max_pixels: int | None = None,
    ):
        super().__init__(message, name)
        self.width, self.height, self.pixels, self.max_pixels = width, height, pixels, max_pixels


class UnreadableImageError(ImageDecodeError, OSError):
    """The file cannot be read (missing, a folder, no permission, a symbolic link that is
    dangling or in a loop: the message then says which)."""


class CorruptImageError(ImageDecodeError, OSError):
    """The header parses but the pixels cannot be decoded (truncated or corrupt data)."""


class UnsupportedImageError(ImageDecodeError):
    """Decoded, but with no 8-bit RGB meaning under the rules (module docstring)."""


@dataclass(frozen=True)
class ImageHeader:
    """What an image's header says, read without decoding a pixel."""

    width: int
    height: int
    mode: str  # PIL's mode of the stored pixels, e.g. "RGB", "I;16", "P"
    format: str | None  # PIL's format name, e.g. "PNG"; None for an in-memory image

    @property
    def pixels(self) -> int:
        return self.width * self.height


def _name_of(source: ImageSource, name: str | None) -> str:
    if name is not None:
        return name
    if isinstance(source, (str, os.PathLike)):
        return os.fspath(source)
    filename = getattr(source, "filename", None) or getattr(source, "name", None)
    return filename if isinstance(filename, str) and filename else _IN_MEMORY


def _open(source: ImageSource, name: str, formats: Sequence[str] | None) -> Image.Image:
    """``source`` opened lazily (only the header read); an ``Image`` is returned as it is."""
    if isinstance(source, Image.Image):
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        source = io.BytesIO(bytes(source))
    accepted = None if formats is None else list(formats)
    try:
        return Image.open(source, formats=accepted)
    except Image.DecompressionBombError as exc:
        raise _too_large_by_pil(name, exc) from None
    except UnidentifiedImageError:
        which = "any format PIL reads" if accepted is None else ", ".join(accepted)
        raise NotAnImageError(
            f"image {name!r} is not an image file of {which}; expected an image file", name
        ) from None
    except OSError as exc:
        if exc.errno is not None:  # from the file system, before PIL read a byte
            raise UnreadableImageError(
                f"image {name!r} cannot be read: {exc.strerror or exc}{_link_note(source)}",
                name,
            ) from exc
        raise CorruptImageError(_corrupt_message(name, exc), name) from exc
    except Exception as exc:  # noqa: BLE001 - a parser's error on hostile bytes is bad input
        raise CorruptImageError(_corrupt_message(name, exc), name) from exc


def _link_note(source: ImageSource) -> str:
    """What is wrong with ``source`` when it is a path to a symbolic link that leads to no
    file: `` (a symbolic link in a loop)`` or `` (a symbolic link to 'x', which leads to
    no file)``; ``""`` for anything else (never raises)."""
    if not isinstance(source, (str, os.PathLike)):
        return ""
    target: Any = None
    try:
        path = os.fspath(source)
        if not os.path.islink(path):
            return ""
        target = os.readlink(path)
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return " (a symbolic link in a loop)"
        if exc.errno in (errno.ENOENT, errno.ENOTDIR) and target is not None:
            return f" (a symbolic link to {target!r}, which leads to no file)"
        return ""
    except (TypeError, ValueError):  # a path the file system refuses (a NUL byte, ...)
        return ""
    return ""


def _corrupt_message(name: str, exc: BaseException) -> str:
    return f"image {name!r} cannot be decoded (corrupt or truncated): {type(exc).__name__}: {exc}"


def _too_large_by_pil(name: str, exc: BaseException) -> ImageTooLargeError:
    found = re.search(r"\((\d+) pixels\)", str(exc))
    pixels = int(found.group(1)) if found else None
    return ImageTooLargeError(
        f"image {name!r} has {'more' if pixels is None else pixels} pixels, beyond "
        f"PIL's decompression-bomb limit of {2 * (Image.MAX_IMAGE_PIXELS or 0)} pixels; "
        "it is not decoded",
        name,
        pixels=pixels,
    )


def _check_budget(
    name: str, width: int, height: int, max_pixels: int | None, budget_name: str | None
) -> None:
    if max_pixels is not None and width * height > max_pixels:
        where = f" ({budget_name})" if budget_name else ""
        raise ImageTooLargeError(
            f"image {name!r} is {width}x{height} = {width * height} pixels; the limit is "
            f"{max_pixels} pixels per image{where}",
            name,
            width=width,
            height=height,
            pixels=width * height,
            max_pixels=max_pixels,
        )


def read_header(
    source: ImageSource, *, name: str | None = None, formats: Sequence[str] | None = None
) -> ImageHeader:
    """The image's size, mode and format from its header alone (no pixel is decoded, so
    a 12000 x 12000 file costs what its header does). Size is as stored: EXIF orientation
    may swap width and height, never the pixel count. ``name``: what errors call the
    image (default: its path). Raises ``NotAnImageError``, ``UnreadableImageError``,
    ``CorruptImageError``, or ``ImageTooLargeError`` beyond PIL's own limit."""
    label = _name_of(source, name)
    img = _open(source, label, formats)
    try:
        width, height = img.size
        return ImageHeader(int(width), int(height), img.mode, img.format)
    finally:
        if img is not source:
            img.close()


def decode_rgb(
    source: ImageSource,
    *,
    name: str | None = None,
    max_pixels: int | None = None,
    formats: Sequence[str] | None = None,
    budget_name: str | None = None,
) -> Image.Image:
    """``source`` fully decoded as an 8-bit, upright ``RGB`` PIL image, by the rules of
    the module docstring.

    ``source``: a path, the file's bytes, a binary file object, or a PIL image (opened or
    in memory; it is not closed, and it is returned itself when it is already loaded
    upright RGB). ``name``: what errors call the image (default: its path).
    ``max_pixels``: the per-image pixel budget, checked from the header before any pixel
    is decoded (``ImageTooLargeError``; ``budget_name`` says in the message which setting
    sets it; PIL's ``DecompressionBombWarning`` is then silenced); None: only PIL's
    decompression-bomb limit applies. ``formats``: PIL format names to accept (default:
    any PIL reads). Raises only ``ImageDecodeError``
    subclasses for bad images."""
    label = _name_of(source, name)
    if max_pixels is None:
        img = _open(source, label, formats)
    else:  # the caller's budget applies: PIL's warning would only repeat it
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = _open(source, label, formats)
    try:
        _check_budget(label, img.size[0], img.size[1], max_pixels, budget_name)
        try:
            img.load()
        except Image.DecompressionBombError as exc:
            raise _too_large_by_pil(label, exc) from None
        except Exception as exc:  # noqa: BLE001 - a decoder's error on hostile bytes
            raise CorruptImageError(_corrupt_message(label, exc), label) from exc
        _check_budget(label, img.size[0], img.size[1], max_pixels, budget_name)
        upright = _upright(img, label)
        try:
            out = _to_rgb(upright, label)
        except ImageDecodeError:
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. data PIL read but cannot convert
            raise CorruptImageError(_corrupt_message(label, exc), label) from exc
        if out is img and img is not source:
            out = img.copy()  # the opened file is closed below; the copy owns its pixels
        return out
    finally:
        if img is not source:
            img.close()


def _upright(img: Image.Image, name: str) -> Image.Image:
    """``img`` with its EXIF orientation applied (itself when it has none)."""
    held = any(key in img.info for key in _EXIF_KEYS) or hasattr(img, "tag_v2")
    if not held and getattr(img, "_exif", None) is None:
        return img  # nowhere to hold an orientation: skip parsing (the benchmark's hot path)
    try:
        orientation = img.getexif().get(_ORIENTATION, 1)
    except Exception:  # noqa: BLE001 - an unparsable EXIF block is ignored, as viewers do
        return img
    if orientation not in _ROTATIONS:
        return img
    try:
        return ImageOps.exif_transpose(img)
    except Exception as exc:  # noqa: BLE001
        raise CorruptImageError(
            f"image {name!r}: its EXIF orientation {orientation} cannot be applied: {exc}", name
        ) from exc


def _has_transparency(img: Image.Image) -> bool:
    if img.mode in _ALPHA_MODES or "transparency" in img.info:
        return True
    return img.mode == "P" and img.palette is not None and img.palette.mode.endswith("A")


def _over_background(rgba: Image.Image) -> Image.Image:
    background = Image.new("RGBA", rgba.size, (*BACKGROUND, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def _to_rgb(img: Image.Image, name: str) -> Image.Image:
    """A loaded, upright image in any mode -> 8-bit RGB (module docstring's rules)."""
    if img.mode in _SIXTEEN_BIT or img.mode in ("I", "F"):
        return _wide_to_rgb(img, name)
    if _has_transparency(img):
        return _over_background(img.convert("RGBA"))
    if img.mode == "RGB":
        return img
    try:
        return img.convert("RGB")
    except ValueError as exc:  # "conversion from LAB to RGB not supported", ...
        raise UnsupportedImageError(
            f"image {name!r} has mode {img.mode!r}, which has no 8-bit RGB conversion: {exc}", name
        ) from None


def _wide_to_rgb(img: Image.Image, name: str) -> Image.Image:
    """16-bit, 32-bit integer and float grayscale -> 8-bit RGB."""
    arr = np.asarray(img)
    if img.mode == "F":
        if not np.isfinite(arr).all():
            raise UnsupportedImageError(
                f"image {name!r} is 32-bit float with NaN or infinite values", name
            )
        levels = np.rint(arr.astype(np.float64) * 255.0)
        lo, hi = float(levels.min(initial=0.0)), float(levels.max(initial=0.0))
        if lo < 0 or hi > 255:
            raise UnsupportedImageError(
                f"image {name!r} is 32-bit float with values in [{float(arr.min()):.6g}, "
                f"{float(arr.max()):.6g}]; float images must be on the 0..1 scale (save it "
                "as 8- or 16-bit, or scale it to 0..1)",
                name,
            )
        gray = levels.astype(np.uint8)
    else:
        values = arr.astype(np.int64)
        if img.mode == "I" and values.size and (values.min() < 0 or values.max() > 65535):
            raise UnsupportedImageError(
                f"image {name!r} is 32-bit integer with values in [{int(values.min())}, "
                f"{int(values.max())}]; expected 16-bit samples (0..65535), the only integer "
                "depth beyond 8 bits with an agreed 8-bit meaning",
                name,
            )
        gray = (values >> 8).astype(np.uint8)
    rgb = Image.fromarray(np.repeat(gray[..., None], 3, axis=-1), "RGB")
    key = img.info.get("transparency")
    if isinstance(key, (int, float)) and not isinstance(key, bool):  # a gray colour key
        alpha = np.where(arr == key, 0, 255).astype(np.uint8)
        rgba = np.concatenate([np.asarray(rgb), alpha[..., None]], axis=-1)
        return _over_background(Image.fromarray(rgba, "RGBA"))
    return rgb


#: Standalone JPEG markers (no length field): TEM and the restart markers RST0-RST7.
_STANDALONE = frozenset([0x01, *range(0xD0, 0xD8)])


def _plainly_baseline(data: bytes) -> bool:
    """True when the markers before the first scan show what ``is_plain_jpeg`` accepts
    without doubt: one baseline or extended-sequential Huffman frame (SOF0/SOF1) of 8-bit
    samples with 1 or 3 components, and no EXIF segment. False means "not shown": PIL's
    parse decides (EXIF, other frames, anything unusual). A walk over the segment lengths;
    PIL's header parse costs ~10x more per file, a tenth of a 224 px decode."""
    n, i, frame = len(data), 2, None
    while i + 4 <= n:
        if data[i] != 0xFF:
            return False
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in _STANDALONE:
            i += 2
            continue
        length = (data[i + 2] << 8) | data[i + 3]
        if length < 2 or marker == 0xD9:
            return False
        if marker == 0xDA:  # start of scan: the header is complete
            return frame is not None
        segment = data[i + 4 : i + 2 + length]
        if marker == 0xE1 and segment[:4] == b"Exif":
            return False
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # a frame (SOFn)
            plain = marker in (0xC0, 0xC1) and len(segment) >= 6
            if frame is not None or not plain or segment[0] != 8 or segment[5] not in (1, 3):
                return False
            frame = marker
        i += 2 + length
    return False


def is_plain_jpeg(data: bytes) -> bool:
    """Whether ``data`` is a plain JPEG: baseline (sequential), 8-bit, YCbCr or grayscale,
    upright (no EXIF orientation). Such a file decodes to the same pixels in any
    libjpeg-turbo decoder (``torchvision.io.decode_jpeg`` as PIL), so a fast decoder may
    take it; everything else (progressive, CMYK, 12-bit, oriented, not JPEG) must go
    through ``decode_rgb``. Reads the header only (``_plainly_baseline`` first, PIL's
    parse where that does not settle it); False for anything it cannot parse."""
    if data[:2] != b"\xff\xd8":
        return False
    if _plainly_baseline(data):
        return True
    try:
        with Image.open(io.BytesIO(data), formats=["JPEG"]) as img:
            info: dict[str, Any] = img.info
            if img.mode not in ("RGB", "L") or getattr(img, "bits", 8) != 8:
                return False
            if info.get("progressive") or info.get("progression"):
                return False
            return img.getexif().get(_ORIENTATION, 1) not in _ROTATIONS
    except Exception:  # noqa: BLE001 - not a JPEG PIL parses: not plain
        return False
