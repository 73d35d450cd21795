"""The limits of ``tta-bench serve``, each declared once (``Limits``: default, range, help,
option), and the worst-case memory uploads can take under them (``upload_memory_bound``).
The command's limit options are generated from the declaration (``limit_options``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tta_bench.bounds import bounded, check_values

__all__ = [
    "Limits",
    "LimitOption",
    "limit_options",
    "limits_from_options",
    "upload_memory_bound",
    "PREFIX",
]

#: The key prefix of a limit in an out-of-range message (``serve.workers=0 is out of range``).
PREFIX = "serve"
MIB = 2**20


def _limit(default: int | float, help: str, *, mib: bool = False) -> Any:
    """A limit's field: ``default``, positive (``bounded``), its option's ``help``; ``mib``:
    a byte count its option sets in MiB (``max_body_bytes`` from ``--max-body-mb``)."""
    declared = bounded(default, gt=0)
    return dataclasses.field(
        default=default, metadata={**declared.metadata, "help": help, "mib": mib}
    )


@dataclass
class Limits:
    """What one service accepts and how long it waits for a client (see the package
    docstring); every field is a positive number (ValueError naming it otherwise).

    ``max_request_pixels``: decoded pixels of all the images of one request, summed from
    their headers before any is decoded. ``max_reading_bytes``: bytes of request bodies
    being received at once, over all connections, counted as they arrive.
    ``header_timeout_s``: from a connection's opening (or its previous response) to the end
    of the request's headers. ``body_timeout_s``: from the request's headers to the end of
    its body. ``keep_alive_s``: a connection without data for this long is closed
    (uvicorn's ``timeout_keep_alive``; or after ``header_timeout_s``, if that is shorter)."""

    workers: int = _limit(2, "requests computing at once (%(default)s)")
    max_pending: int = _limit(
        32, "requests admitted at once, each once its body has arrived (%(default)s)"
    )
    max_body_bytes: int = _limit(16 * MIB, "request body limit (%(default)g MiB)", mib=True)
    max_reading_bytes: int = _limit(
        256 * MIB,
        "bytes of bodies being received at once, all connections (%(default)g MiB)",
        mib=True,
    )
    max_image_pixels: int = _limit(16_000_000, "pixels per image (%(default)s)")
    max_request_pixels: int = _limit(
        64_000_000, "decoded pixels per request, all its images (%(default)s)"
    )
    max_images: int = _limit(64, "images per request (%(default)s)")
    max_sessions: int = _limit(64, "open sessions (%(default)s)")
    session_idle_s: float = _limit(600.0, "idle session timeout (%(default)g s)")
    header_timeout_s: float = _limit(10.0, "time to send a request's headers (%(default)g s)")
    body_timeout_s: float = _limit(
        10.0, "time to send a request's body, after its headers (%(default)g s)"
    )
    keep_alive_s: float = _limit(
        5.0, "a connection without data is closed after this (%(default)g s)"
    )
    top_k: int = _limit(5, "classes listed per image (%(default)s)")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError(f"limit {f.name} must be a number, got {value!r}")
        check_values(self, PREFIX)
        if self.max_reading_bytes < self.max_body_bytes:
            raise ValueError(
                f"limit max_reading_bytes ({self.max_reading_bytes}, --max-reading-mb) must be "
                f"at least max_body_bytes ({self.max_body_bytes}, --max-body-mb): a whole body "
                "must fit in what may be received at once"
            )


@dataclass(frozen=True)
class LimitOption:
    """The command-line option of one ``Limits`` field, as its declaration describes it."""

    field: str  # the Limits field
    dest: str  # the option's name on the command line's namespace (max_body_mb)
    type: type  # int or float
    default: int | float  # in the option's unit
    scale: int  # the field's value per unit of the option (MIB for a MiB option)
    help: str
    declared: dataclasses.Field  # the field itself (its bounds)

    @property
    def flag(self) -> str:
        return "--" + self.dest.replace("_", "-")


def limit_options() -> Iterator[LimitOption]:
    """One option per ``Limits`` field, in declaration order: ``--workers`` for
    ``workers``, ``--max-body-mb`` (a float, in MiB) for ``max_body_bytes``."""
    for f in dataclasses.fields(Limits):
        if f.metadata["mib"]:
            dest, kind, scale = f.name.removesuffix("_bytes") + "_mb", float, MIB
        else:
            dest, kind, scale = f.name, type(f.default), 1
        yield LimitOption(
            f.name, dest, kind, f.default / scale if scale != 1 else f.default, scale,
            f.metadata["help"], f,
        )  # fmt: skip


def _options_class() -> type:
    """A dataclass of the limit options in their own units (``max_body_mb``), each with its
    field's bounds (positive: the same in any unit), so that ``check_values`` names the
    value as the command line gave it."""
    fields = [
        (o.dest, o.type, dataclasses.field(default=o.default, metadata=o.declared.metadata))
        for o in limit_options()
    ]
    return dataclasses.make_dataclass("LimitOptions", fields)


_LimitOptions = _options_class()


def limits_from_options(values: Any) -> Limits:
    """The ``Limits`` of a command line's limit options (``values``: its namespace): every
    value checked in its option's unit first (``check_values``: ``serve.max_body_mb=-1.0 is
    out of range: it must be > 0``), then converted (MiB to whole bytes)."""
    options = list(limit_options())
    check_values(_LimitOptions(**{o.dest: getattr(values, o.dest) for o in options}), PREFIX)
    return Limits(
        **{
            o.field: int(getattr(values, o.dest) * o.scale)
            if o.scale != 1
            else getattr(values, o.dest)
            for o in options
        }
    )


#: Bytes per pixel PIL keeps for a decoded image: 4 for RGB (stored as RGBX), RGBA, CMYK,
#: I and F, the widest modes; 1 or 2 for L, P and I;16.
_PIL_BYTES_PER_PIXEL = 4
#: Full-size copies of one image a worker holds at once while decoding and resizing it: the
#: image in its own mode and its RGB conversion (``decode_image``), then the RGB copy and
#: the resize result (at most ``max_image_pixels`` too, see ``check_headers``) in
#: ``tta_bench.data.to_rgb_array``; the image it was converted from is freed by then.
_FULL_SIZE_COPIES = 3
#: Bytes per input value of a request's batch: the per-image float tensors and their
#: concatenation (4 + 4; on the model's device); the uint8 array and intermediate float
#: copy of the one image being preprocessed are negligible beside them.
_BATCH_BYTES_PER_VALUE = 8


def upload_memory_bound(limits: Limits, image_size: int) -> dict[str, int]:
    """Upper bound, in bytes, of the memory uploads can take at once under ``limits`` for a
    model of input size ``image_size`` (computed, not measured), term by term and
    ``total``; beyond it: the model, the sessions and the method's own activations.

    * ``receiving``: bodies still arriving, ``max_reading_bytes`` (counted as they arrive);
    * ``admitted``: bodies of admitted requests, ``max_pending x max_body_bytes`` (their
      parts replace them once split), plus one more ``max_body_bytes`` for the body being
      split on the event loop next to its parts;
    * ``decoding``: ``workers x 3 x max_image_pixels x 4`` bytes: a worker decodes and
      resizes one image at a time, holding at most 3 full-size copies of it at 4 bytes per
      pixel (``_FULL_SIZE_COPIES``, ``_PIL_BYTES_PER_PIXEL``);
    * ``batches``: ``workers x max_images x 3 x image_size**2 x 8`` bytes of input tensors
      (``_BATCH_BYTES_PER_VALUE``).
    """
    terms = {
        "receiving": limits.max_reading_bytes,
        "admitted": (limits.max_pending + 1) * limits.max_body_bytes,
        "decoding": limits.workers
        * _FULL_SIZE_COPIES
        * limits.max_image_pixels
        * _PIL_BYTES_PER_PIXEL,
        "batches": limits.workers * limits.max_images * 3 * image_size**2 * _BATCH_BYTES_PER_VALUE,
    }
    return {**terms, "total": sum(terms.values())}
