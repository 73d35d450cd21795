"""The uploads of ``tta-bench serve``, in memory: a request body read under the service's
deadline and byte limits (``read_body``), split into images (``split_uploads``: a
multipart form or one raw image), every image's header checked against the pixel limits
before any is decoded (``check_headers``), and each decoded as the runner decodes files
(``decode_image``: ``tta_bench.run.images.decode_rgb``). A refusal is a ``ClientError``: an
HTTP status and a message naming the limit. Nothing here is written to disk. ``service``
and ``limits`` are ``tta_bench.deploy.serve``'s ``Service`` and ``Limits`` (not imported here:
serve imports this module).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

__all__ = [
    "ACCEPTED_FORMATS",
    "ClientError",
    "check_headers",
    "decode_image",
    "image_header_size",
    "read_body",
    "split_uploads",
]

#: Formats PIL may open (no EPS/PDF and friends: they run external programs).
ACCEPTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
#: The server's log (uvicorn's): one line per misbehaving client, never a traceback.
_log = logging.getLogger("uvicorn.error")


class ClientError(Exception):
    """A request the service refuses: an HTTP status and a message for the client."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


def _closing(headers: dict[str, str] | None = None) -> dict[str, str]:
    """``headers`` plus ``Connection: close``: the answer to a request whose body was not
    (wholly) read ends its connection, so nothing of that body is read afterwards."""
    return {**(headers or {}), "Connection": "close"}


def _client(request: Any) -> str:
    client = request.client
    return f"{client[0]}:{client[1]}" if client else "(unknown client)"


# -- uploads: read, split and decode in memory ---------------------------------------------
async def read_body(request: Any, service: Any) -> bytes:
    """The whole request body, held to ``service.limits``:

    * 413 as soon as it exceeds ``max_body_bytes`` (from ``Content-Length``, then as it
      arrives);
    * 408 when it has not wholly arrived ``body_timeout_s`` after the call;
    * 503 (``Retry-After``) when its next chunk would take the bytes being received by all
      requests at once (``service.reading_bytes``, counted as they arrive, not as declared)
      past ``max_reading_bytes``;
    * a client that disconnects meanwhile is one warning line in the server's log and a
      ``ClientError`` (400) whose answer goes nowhere.

    Every refusal carries ``Connection: close``."""
    limits = service.limits
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise ClientError(400, f"bad Content-Length {declared!r}", _closing()) from None
        if size > limits.max_body_bytes:
            raise ClientError(413, _body_message(size, limits.max_body_bytes), _closing())
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limits.body_timeout_s
    chunks: list[bytes] = []
    total = 0
    service.reading += 1
    try:
        while True:
            try:
                message = await asyncio.wait_for(request.receive(), deadline - loop.time())
            except asyncio.TimeoutError:
                _log.warning(
                    "client %s: %d of %s body bytes arrived within %g s; answered 408 "
                    "(--body-timeout-s)",
                    _client(request),
                    total,
                    declared or "(chunked)",
                    limits.body_timeout_s,
                )
                raise ClientError(
                    408,
                    f"request body not received within {limits.body_timeout_s:g} s "
                    f"({total} of {declared or 'the'} bytes arrived), the limit "
                    "(--body-timeout-s); send the whole body at once",
                    _closing(),
                ) from None
            if message["type"] == "http.disconnect":
                _log.warning(
                    "client %s disconnected after %d of %s body bytes of %s %s",
                    _client(request),
                    total,
                    declared or "(chunked)",
                    request.method,
                    request.url.path,
                )
                raise ClientError(400, "client disconnected during the upload", _closing())
            chunk = message.get("body", b"")
            if chunk:
                if total + len(chunk) > limits.max_body_bytes:
                    raise ClientError(
                        413, _body_message(total + len(chunk), limits.max_body_bytes), _closing()
                    )
                if service.reading_bytes + len(chunk) > limits.max_reading_bytes:
                    raise ClientError(
                        503,
                        f"busy: {service.reading_bytes} bytes of uploads are being received "
                        f"and the next {len(chunk)} of this one would pass the limit of "
                        f"{limits.max_reading_bytes} bytes (--max-reading-mb); retry shortly",
                        _closing({"Retry-After": "1"}),
                    )
                service.reading_bytes += len(chunk)
                total += len(chunk)
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
    finally:
        service.reading -= 1
        service.reading_bytes -= total
    return b"".join(chunks)


def _body_message(size: int, limit: int) -> str:
    return (
        f"request body of {size} bytes exceeds the limit of {limit} bytes "
        "(--max-body-mb); send fewer or smaller images per request"
    )


def split_uploads(body: bytes, content_type: str, max_images: int) -> list[tuple[str, bytes]]:
    """``(file name, bytes)`` of each uploaded image: the file parts of a multipart body
    (parsed in memory), or a raw ``image/*`` / ``application/octet-stream`` body."""
    from python_multipart.multipart import parse_options_header

    ctype, params = parse_options_header(content_type or "")
    ctype_s = ctype.decode("latin-1").lower()
    if ctype_s == "multipart/form-data":
        boundary = params.get(b"boundary")
        if not boundary:
            raise ClientError(400, "multipart/form-data body without a boundary")
        uploads = _parse_multipart(body, boundary, max_images)
    elif ctype_s.startswith("image/") or ctype_s == "application/octet-stream":
        uploads = [("image", body)] if body else []
    else:
        raise ClientError(
            415,
            f"unsupported Content-Type {ctype_s or '(none)'!r}: send images as "
            "multipart/form-data file parts (curl -F image=@a.png) or one raw image/* body",
        )
    if not uploads:
        raise ClientError(422, "no images in the request: send at least one image file part")
    if len(uploads) > max_images:
        raise ClientError(
            413, f"{len(uploads)} images in one request; the limit is {max_images} (--max-images)"
        )
    return uploads


def _parse_multipart(body: bytes, boundary: bytes, max_images: int) -> list[tuple[str, bytes]]:
    from python_multipart.exceptions import MultipartParseError
    from python_multipart.multipart import MultipartParser, parse_options_header

    parts: list[tuple[dict[bytes, bytes], bytes]] = []
    cur: dict[str, Any] = {}

    def on_part_begin() -> None:
        cur.update(headers={}, field=bytearray(), value=bytearray(), data=[])

    def on_header_field(data: bytes, start: int, end: int) -> None:
        cur["field"] += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        cur["value"] += data[start:end]

    def on_header_end() -> None:
        cur["headers"][bytes(cur["field"]).lower()] = bytes(cur["value"])
        cur["field"], cur["value"] = bytearray(), bytearray()

    def on_part_data(data: bytes, start: int, end: int) -> None:
        cur["data"].append(bytes(data[start:end]))

    def on_part_end() -> None:
        parts.append((cur["headers"], b"".join(cur["data"])))
        if len(parts) > max_images:
            raise ClientError(
                413,
                f"more than {max_images} parts in one request; the limit is {max_images} "
                "images (--max-images)",
            )

    callbacks = {
        "on_part_begin": on_part_begin,
        "on_header_field": on_header_field,
        "on_header_value": on_header_value,
        "on_header_end": on_header_end,
        "on_part_data": on_part_data,
        "on_part_end": on_part_end,
    }
    parser = MultipartParser(boundary, callbacks)  # type: ignore[arg-type]
    try:
        parser.write(body)
        parser.finalize()
    except MultipartParseError as exc:
        raise ClientError(400, f"malformed multipart body: {exc}") from None
    out = []
    for headers, data in parts:
        _, opts = parse_options_header(headers.get(b"content-disposition", b""))
        name = opts.get(b"name", b"").decode("utf-8", "replace")
        filename = opts.get(b"filename")
        if filename is None:
            raise ClientError(
                422,
                f"unexpected form field {name!r}: send images as file parts (curl -F "
                "image=@a.png); options such as top_k and session are query parameters",
            )
        out.append((filename.decode("utf-8", "replace") or name or "image", data))
    return out


def _client_error(exc: Exception, name: str) -> ClientError:
    """The HTTP answer to ``tta_bench.run.images``' refusal of image ``name``: 415 for data that
    is no image in an accepted format, 413 for too many pixels, 422 for the rest."""
    from tta_bench.run import images

    if isinstance(exc, images.NotAnImageError):
        accepted = ", ".join(ACCEPTED_FORMATS)
        return ClientError(
            415, f"image {name!r} is not an image in an accepted format ({accepted})"
        )
    if isinstance(exc, images.ImageTooLargeError):
        return ClientError(413, str(exc))
    return ClientError(422, f"image {name!r} cannot be decoded: {exc}")


def image_header_size(name: str, data: bytes) -> tuple[int, int]:
    """``(width, height)`` of an image in memory, from its header only
    (``tta_bench.run.images.read_header``: no pixel is decoded); refused as ``decode_image``
    refuses it."""
    from tta_bench.run import images

    try:
        header = images.read_header(data, name=name, formats=ACCEPTED_FORMATS)
    except images.ImageDecodeError as exc:
        raise _client_error(exc, name) from None
    if header.width <= 0 or header.height <= 0:
        raise ClientError(
            422, f"image {name!r} is {header.width}x{header.height}: no pixels to classify"
        )
    return header.width, header.height


def check_headers(uploads: list[tuple[str, bytes]], limits: Any, image_size: int) -> int:
    """The decoded pixels of all ``uploads``, from every image's header, before any image
    is decoded; 413 naming the limit when one image has more than ``max_image_pixels``,
    when resizing one's shorter side to ``image_size`` would make more than
    ``max_image_pixels`` (an elongated image, e.g. 1 x 16,000,000), or when they add up to
    more than ``max_request_pixels``."""
    from tta_bench.run.cache import resized_size

    total = 0
    for name, data in uploads:
        width, height = image_header_size(name, data)
        pixels = width * height
        if pixels > limits.max_image_pixels:
            raise ClientError(
                413,
                f"image {name!r} is {width}x{height} = {pixels} pixels; the limit is "
                f"{limits.max_image_pixels} pixels per image (--max-image-pixels)",
            )
        rw, rh = resized_size(width, height, image_size)
        if rw * rh > limits.max_image_pixels:
            raise ClientError(
                413,
                f"image {name!r} is {width}x{height}: resizing its shorter side to the "
                f"model's {image_size} makes {rw}x{rh} = {rw * rh} pixels; the limit is "
                f"{limits.max_image_pixels} pixels per image (--max-image-pixels); crop it to "
                "a less elongated shape",
            )
        total += pixels
    if total > limits.max_request_pixels:
        raise ClientError(
            413,
            f"the {len(uploads)} images of this request add up to {total} pixels; the limit "
            f"is {limits.max_request_pixels} pixels per request (--max-request-pixels); send "
            "fewer or smaller images per request",
        )
    return total


def decode_image(name: str, data: bytes, max_pixels: int) -> Any:
    """A fully decoded, upright 8-bit RGB PIL image from memory, decoded as the runner,
    ``predict`` and ``Adapter`` decode files (``tta_bench.run.images.decode_rgb``: 16-bit,
    palette, alpha, CMYK and EXIF-rotated images included); the header's pixel count is
    checked against ``max_pixels`` before any pixel is decoded."""
    from tta_bench.run import images

    try:
        return images.decode_rgb(
            data,
            name=name,
            max_pixels=max_pixels,
            formats=ACCEPTED_FORMATS,
            budget_name="--max-image-pixels",
        )
    except images.ImageDecodeError as exc:
        raise _client_error(exc, name) from None
