"""``tta-bench serve``: test-time adaptation over HTTP (FastAPI + uvicorn, the optional
extra ``pip install 'tta-bench[serve]'``).

Endpoints (JSON answers; errors are ``{"detail": message}`` with a 4xx status):

* ``POST /predict`` - images as multipart file parts (``curl -F image=@a.png -F
  image=@b.jpg``) or one raw image body (``Content-Type: image/png``); query ``top_k``.
  The method adapts on the request's images as it does on a batch, then predicts them:
  per image ``label``, ``index``, ``score`` (softmax probability) and ``top_k``.
  Without a session the request starts from the state after setup and leaves nothing
  behind; with ``?session=<id>`` (or the header ``X-TTA-Session``) it continues that
  session's adaptation state.
* ``POST /sessions`` (201, ``{"session": id}``), ``GET /sessions/{id}``,
  ``POST /sessions/{id}/reset``, ``DELETE /sessions/{id}``. Ids are random 128-bit
  tokens. A session idle for longer than the idle timeout is closed; its id then answers
  404 saying it expired.
* ``GET /health`` (never guarded) and ``GET /info`` (model, method and its config, class
  names, limits, concurrency policy, memory per session).

State sharing: one frozen backbone for the whole service; every session, and every
pooled sessionless instance, is an ``Adapter.spawn()`` of it (``tta_bench.adapter``):
a copy of only the tensors the method changes plus the method's own state, over the
shared frozen tensors. ``/info`` reports the bytes of both.

Concurrency policy (also in ``/info``):

* at most ``workers`` requests compute at once, on a thread pool of that size; the event
  loop only reads, validates and answers, so ``/health``, ``/info`` and session management
  never wait for an adaptation;
* requests of one session run one at a time, in arrival order (a per-session lock; a
  waiting request holds no worker);
* sessionless requests each take one of ``workers`` pooled adapters, which is reset
  after the request, so they never see each other's state;
* at most ``max_pending`` predict requests are admitted at once (reading, waiting or
  computing); the next one gets 503 with ``Retry-After``.

Limits (4xx answers naming the limit): body size (413, checked from ``Content-Length``
and while reading), images per request (413), pixels per image (413, read from the image
header before anything is decoded: decompression bombs never expand), accepted formats
(415), open sessions (429), idle sessions (404 after expiry). Uploads are never written
to disk: bodies are read into memory and multipart is parsed in memory (Starlette's form
parser spools large files to a temporary file, so it is not used). An optional bearer
token (``--token`` or ``$TTA_BENCH_SERVE_TOKEN``) guards every endpoint but ``/health``
(401 without it).
"""

# No ``from __future__ import annotations`` here: FastAPI reads the annotations of the
# endpoint closures in ``create_app`` at runtime, where names imported inside the
# function would not resolve from strings.

import argparse
import asyncio
import contextlib
import dataclasses
import hmac
import io
import os
import queue
import secrets
import socket
import sys
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Limits",
    "Service",
    "ClientError",
    "MissingExtraError",
    "create_app",
    "running",
    "serve",
    "require_extra",
    "add_arguments",
    "main",
    "POLICY",
    "TOKEN_ENV",
    "SESSION_HEADER",
    "ACCEPTED_FORMATS",
]

TOKEN_ENV = "TTA_BENCH_SERVE_TOKEN"
SESSION_HEADER = "X-TTA-Session"
#: Formats PIL may open (no EPS/PDF and friends: they run external programs).
ACCEPTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
POLICY = (
    "at most `workers` requests compute at once (a thread pool); the event loop never "
    "adapts, so /health, /info and session management answer while adaptations run; one "
    "request at a time per session, in arrival order (per-session lock, no worker held "
    "while waiting); sessionless requests use one of `workers` pooled adapters, reset after "
    "each request; at most `max_pending` predict requests admitted at once (503 beyond)"
)


class MissingExtraError(ValueError):
    """The optional ``serve`` dependencies are not installed."""


def require_extra() -> None:
    """Raise ``MissingExtraError`` naming ``pip install 'tta-bench[serve]'`` when FastAPI,
    uvicorn or python-multipart cannot be imported."""
    missing = []
    for module, dist in (
        ("fastapi", "fastapi"),
        ("uvicorn", "uvicorn"),
        ("python_multipart", "python-multipart"),
    ):
        try:
            __import__(module)
        except ImportError:
            missing.append(dist)
    if missing:
        raise MissingExtraError(
            f"tta-bench serve needs the optional dependencies {', '.join(missing)}: "
            "pip install 'tta-bench[serve]'"
        )


@dataclass
class Limits:
    """What one service accepts (see the module docstring)."""

    max_body_bytes: int = 16 << 20
    max_image_pixels: int = 16_000_000
    max_images: int = 64
    max_sessions: int = 64
    session_idle_s: float = 600.0
    max_pending: int = 32
    workers: int = 2
    top_k: int = 5

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"limit {f.name} must be a positive number, got {value!r}")


class ClientError(Exception):
    """A request the service refuses: an HTTP status and a message for the client."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


# -- uploads: read, split and decode in memory ---------------------------------------------
async def read_body(request: Any, limit: int) -> bytes:
    """The request body, refused (413) as soon as it exceeds ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise ClientError(400, f"bad Content-Length {declared!r}") from None
        if size > limit:
            raise ClientError(413, _body_message(size, limit))
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise ClientError(413, _body_message(total, limit))
        chunks.append(chunk)
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


def decode_image(name: str, data: bytes, max_pixels: int) -> Any:
    """A fully decoded RGB PIL image from memory; the pixel count is read from the header
    and checked against ``max_pixels`` before any pixel is decoded."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            # our own limit applies below; PIL's warning would only repeat it in the log
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS)
    except Image.DecompressionBombError as exc:
        raise ClientError(413, f"image {name!r}: {exc}") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise ClientError(
            415,
            f"image {name!r} is not an image in an accepted format ({', '.join(ACCEPTED_FORMATS)})",
        ) from None
    width, height = img.size
    if width * height > max_pixels:
        raise ClientError(
            413,
            f"image {name!r} is {width}x{height} = {width * height} pixels; the limit is "
            f"{max_pixels} pixels per image (--max-image-pixels)",
        )
    try:
        img.load()
        return img.convert("RGB")
    except (OSError, ValueError, SyntaxError) as exc:
        raise ClientError(422, f"image {name!r} cannot be decoded: {exc}") from None


# -- the service -----------------------------------------------------------------------------
@dataclass
class Session:
    id: str
    adapter: Any
    created: float
    last_used: float
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: Held by the worker thread during a call: serialises a session even when a waiting
    #: request was cancelled (its asyncio lock released) while its computation still runs.
    thread_lock: threading.Lock = field(default_factory=threading.Lock)
    busy: int = 0
    requests: int = 0


class Service:
    """The state behind the HTTP app: the shared backbone's adapters, the sessions, the
    worker pool and the limits. All bookkeeping runs on the event loop's thread; only
    decoding and the method's calls run on the worker threads."""

    def __init__(self, adapter: Any, limits: Limits | None = None, *, token: str | None = None):
        self.limits = limits or Limits()
        self.token = token or None
        self.template = adapter
        self.executor = ThreadPoolExecutor(self.limits.workers, thread_name_prefix="tta-serve")
        # One pooled adapter per worker: a sessionless request never waits for one.
        self.pool: queue.SimpleQueue[Any] = queue.SimpleQueue()
        for _ in range(self.limits.workers):
            self.pool.put(adapter.spawn())
        self.sessions: dict[str, Session] = {}
        self.expired: OrderedDict[str, float] = OrderedDict()
        self.pending = 0  # admitted predict requests
        self.computing = 0  # requests on the worker pool now
        self._creating = 0
        self.started = time.time()
        self.memory = self._measure_memory()

    # -- bookkeeping ------------------------------------------------------------------------
    def _measure_memory(self) -> dict[str, Any]:
        """Tensor bytes of the shared backbone, of one session at rest and after one
        adaptation call (optimiser state appears then), and of a whole-model copy."""
        import torch

        scratch = self.template.spawn()
        at_rest = scratch.state_bytes()
        size = scratch.image_size
        scratch(torch.full((1, 3, size, size), 0.5))
        after = scratch.state_bytes()
        backbone = self.template.backbone
        return {
            "shared_backbone_bytes": backbone.shared_bytes,
            "session_bytes_at_rest": at_rest,
            "session_bytes_after_a_request": after,
            "whole_model_copy_bytes": backbone.model_bytes,
            "adapted_base_tensors": list(backbone.adapted),
        }

    async def run(self, fn: Any, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        self.computing += 1
        try:
            return await loop.run_in_executor(self.executor, fn, *args)
        finally:
            self.computing -= 1

    def sweep(self) -> None:
        """Close the sessions idle for longer than the limit (never a busy one)."""
        now = time.monotonic()
        for sid, s in list(self.sessions.items()):
            if s.busy == 0 and now - s.last_used > self.limits.session_idle_s:
                self._expire(sid, now)

    def _expire(self, sid: str, now: float) -> None:
        self.sessions.pop(sid, None)
        self.expired[sid] = now
        while len(self.expired) > 10_000:  # remember recent ids only
            self.expired.popitem(last=False)

    def session(self, sid: str) -> Session:
        now = time.monotonic()
        s = self.sessions.get(sid)
        if s is not None and s.busy == 0 and now - s.last_used > self.limits.session_idle_s:
            self._expire(sid, now)
            s = None
        if s is not None:
            return s
        if sid in self.expired:
            raise ClientError(
                404,
                f"session {sid!r} expired: it was idle for more than "
                f"{self.limits.session_idle_s:g} s; create a new one with POST /sessions",
            )
        raise ClientError(404, f"unknown session {sid!r}; create one with POST /sessions")

    async def create_session(self) -> Session:
        self.sweep()
        if len(self.sessions) + self._creating >= self.limits.max_sessions:
            raise ClientError(
                429,
                f"{self.limits.max_sessions} sessions are open, the limit (--max-sessions); "
                "DELETE /sessions/{id} the ones you no longer need, or wait for idle ones to "
                f"expire after {self.limits.session_idle_s:g} s",
            )
        self._creating += 1
        try:
            adapter = await self.run(self.template.spawn)
        finally:
            self._creating -= 1
        now = time.monotonic()
        s = Session(secrets.token_urlsafe(16), adapter, now, now)
        self.sessions[s.id] = s
        return s

    # -- work on the pool -------------------------------------------------------------------
    def _preprocess(self, uploads: list[tuple[str, bytes]]) -> Any:
        images = [decode_image(n, d, self.limits.max_image_pixels) for n, d in uploads]
        return self.template.preprocess(images)

    def _pooled(self, x: Any) -> Any:
        adapter = self.pool.get()
        try:
            return adapter(x)
        finally:
            adapter.reset()  # the next sessionless request starts from setup again
            self.pool.put(adapter)

    @staticmethod
    def _in_session(s: Session, x: Any) -> Any:
        with s.thread_lock:
            return s.adapter(x)

    async def predict(self, uploads: list[tuple[str, bytes]], sid: str | None, k: int) -> dict:
        s = self.session(sid) if sid is not None else None
        if s is None:
            x = await self.run(self._preprocess, uploads)
            start = time.perf_counter()
            pred = await self.run(self._pooled, x)
        else:
            s.busy += 1  # a busy session never expires
            try:
                x = await self.run(self._preprocess, uploads)
                start = time.perf_counter()
                async with s.lock:
                    pred = await self.run(self._in_session, s, x)
                    s.requests += 1
            finally:
                s.busy -= 1
                s.last_used = time.monotonic()
        seconds = time.perf_counter() - start
        rows = pred.records(k)
        return {
            "session": sid,
            "method": self.template.method_name,
            "loss": pred.loss,
            "seconds": seconds,
            "predictions": [{"file": name, **row} for (name, _), row in zip(uploads, rows)],
        }

    def info(self) -> dict[str, Any]:
        from tta_bench import __version__

        t = self.template
        model = t.model
        return {
            "service": "tta-bench",
            "version": __version__,
            "model": {
                "name": getattr(model, "model_name", None),
                "weights": getattr(model, "weights", None),
                "image_size": t.image_size,
            },
            "method": t.method_name,
            "method_config": t.config_dict,
            "classnames": t.classnames,
            "templates": list(model.templates),
            "device": str(t.device),
            "limits": {**dataclasses.asdict(self.limits), "accepted_formats": ACCEPTED_FORMATS},
            "auth": "bearer" if self.token else "none",
            "concurrency": {"workers": self.limits.workers, "policy": POLICY},
            "sessions": {
                "open": len(self.sessions),
                "max": self.limits.max_sessions,
                "idle_timeout_s": self.limits.session_idle_s,
            },
            "load": {"pending": self.pending, "computing": self.computing},
            "memory": self.memory,
            "uptime_s": time.time() - self.started,
        }

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


# -- the HTTP app ------------------------------------------------------------------------------
def create_app(service: Service) -> Any:
    """The FastAPI app of ``service`` (see the module docstring for the endpoints)."""
    require_extra()
    from fastapi import Depends, FastAPI, Request
    from fastapi.responses import JSONResponse

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any):
        async def sweeper() -> None:
            period = max(0.05, min(30.0, service.limits.session_idle_s / 4))
            while True:
                await asyncio.sleep(period)
                service.sweep()

        task = asyncio.create_task(sweeper())
        try:
            yield
        finally:
            task.cancel()
            service.close()

    app = FastAPI(title="tta-bench", description="Test-time adaptation service", lifespan=lifespan)

    @app.exception_handler(ClientError)
    async def client_error(_request: Request, exc: ClientError) -> JSONResponse:
        return JSONResponse({"detail": exc.message}, status_code=exc.status, headers=exc.headers)

    def authorised(request: Request) -> None:
        _authorise(service, request)

    guarded = [Depends(authorised)]

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/info", dependencies=guarded)
    async def info() -> dict:
        return service.info()

    @app.post("/predict", dependencies=guarded)
    async def predict(request: Request, session: str | None = None, top_k: int | None = None):
        return await _predict(service, request, session, top_k)

    _add_session_routes(app, service, guarded)
    return app


def _authorise(service: Service, request: Any) -> None:
    """Every endpoint but ``/health``: the bearer token, when the service has one."""
    if service.token is None:
        return
    scheme, _, credential = request.headers.get("authorization", "").partition(" ")
    good = scheme.lower() == "bearer" and hmac.compare_digest(
        credential.strip().encode(), service.token.encode()
    )
    if not good:
        raise ClientError(
            401,
            "missing or wrong bearer token: send the header 'Authorization: Bearer <token>'",
            {"WWW-Authenticate": "Bearer"},
        )


async def _predict(service: Service, request: Any, session: str | None, top_k: int | None):
    """``POST /predict``: checks first (session names, top_k, the pending limit, the
    session exists), then the body is read in memory, split and predicted."""
    header = request.headers.get(SESSION_HEADER)
    if session is not None and header is not None and session != header:
        raise ClientError(
            422, f"two sessions named: ?session={session!r} and {SESSION_HEADER}: {header!r}"
        )
    sid = session if session is not None else header
    classes = len(service.template.classnames)
    k = service.limits.top_k if top_k is None else top_k
    if not 1 <= k <= classes:
        raise ClientError(422, f"top_k must be in 1..{classes} (the classes), got {k}")
    if service.pending >= service.limits.max_pending:
        raise ClientError(
            503,
            f"busy: {service.pending} requests in progress, the limit (--max-pending); "
            "retry shortly",
            {"Retry-After": "1"},
        )
    service.pending += 1
    try:
        if sid is not None:
            service.session(sid)  # unknown or expired: 404 before reading the body
        body = await read_body(request, service.limits.max_body_bytes)
        uploads = split_uploads(
            body, request.headers.get("content-type", ""), service.limits.max_images
        )
        return await service.predict(uploads, sid, k)
    finally:
        service.pending -= 1


def _add_session_routes(app: Any, service: Service, guarded: list[Any]) -> None:
    """``/sessions``: create, describe, reset, delete."""

    @app.post("/sessions", dependencies=guarded, status_code=201)
    async def create_session() -> dict:
        s = await service.create_session()
        return {
            "session": s.id,
            "method": service.template.method_name,
            "idle_timeout_s": service.limits.session_idle_s,
        }

    @app.get("/sessions/{sid}", dependencies=guarded)
    async def get_session(sid: str) -> dict:
        s = service.session(sid)
        return {
            "session": s.id,
            "requests": s.requests,
            "busy": s.busy > 0,
            "idle_s": time.monotonic() - s.last_used,
            "idle_timeout_s": service.limits.session_idle_s,
        }

    @app.post("/sessions/{sid}/reset", dependencies=guarded)
    async def reset_session(sid: str) -> dict:
        s = service.session(sid)
        s.busy += 1
        try:
            async with s.lock:
                await service.run(lambda: _locked(s, s.adapter.reset))
                s.requests = 0
        finally:
            s.busy -= 1
            s.last_used = time.monotonic()
        return {"session": sid, "reset": True}

    @app.delete("/sessions/{sid}", dependencies=guarded)
    async def delete_session(sid: str) -> dict:
        service.session(sid)
        service.sessions.pop(sid, None)
        return {"session": sid, "deleted": True}


def _locked(s: Session, fn: Any) -> Any:
    with s.thread_lock:
        return fn()


# -- running it ------------------------------------------------------------------------------
def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc}") from exc
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


@contextlib.contextmanager
def running(service: Service, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve ``service`` from a background thread (tests, notebooks); yields the base URL
    and stops the server when the block exits. ``port=0``: a free port."""
    import uvicorn

    sock = _bind(host, port)
    url = f"http://{host}:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(create_app(service), log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {url} did not start")
            time.sleep(0.01)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def serve(
    service: Service, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning"
) -> None:
    """Serve until Ctrl-C (SIGINT) or SIGTERM; prints the URL once listening."""
    require_extra()
    import uvicorn

    sock = _bind(host, port)
    url = f"http://{host}:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(create_app(service), log_level=log_level, lifespan="on"))
    print(
        f"tta-bench serve: {service.template.method_name} on {url} "
        f"(workers {service.limits.workers}, auth {'bearer' if service.token else 'none'}); "
        "Ctrl-C stops",
        flush=True,
    )
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()


# -- the command -------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``tta-bench serve`` options (the CLI calls this; no heavy imports)."""
    d = Limits()
    p.add_argument("--method", help="method name (tta-bench ls methods); default: the catalogues'")
    p.add_argument("--model", help="model name (tta-bench ls models); default: the catalogues'")
    p.add_argument(
        "--model-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a model factory argument, e.g. arch=ViT-B-32 (repeatable)",
    )
    p.add_argument("--dataset", help="registered dataset whose class names/templates to use")
    p.add_argument("--classnames", help="comma-separated class names (instead of --dataset)")
    p.add_argument(
        "--template", action="append", default=None, help="prompt template with '{}' (repeatable)"
    )
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--seed", type=int, default=0, help="the method's seed")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
    p.add_argument("--port", type=int, default=8000, help="port (0: a free one, printed)")
    p.add_argument(
        "--token",
        default=None,
        help=f"bearer token required by every endpoint but /health "
        f"(default ${TOKEN_ENV}; none: no auth)",
    )
    p.add_argument("--workers", type=int, default=d.workers, help="requests computing at once")
    p.add_argument("--max-pending", type=int, default=d.max_pending, help="admitted requests")
    p.add_argument(
        "--max-body-mb", type=float, default=d.max_body_bytes / 2**20, help="request body limit"
    )
    p.add_argument(
        "--max-image-pixels", type=int, default=d.max_image_pixels, help="pixels per image"
    )
    p.add_argument("--max-images", type=int, default=d.max_images, help="images per request")
    p.add_argument("--max-sessions", type=int, default=d.max_sessions, help="open sessions")
    p.add_argument(
        "--session-idle-s", type=float, default=d.session_idle_s, help="idle session timeout"
    )
    p.add_argument("--top-k", type=int, default=d.top_k, help="classes listed per image")
    p.add_argument("--log-level", default="warning", help="uvicorn log level")
    p.add_argument(
        "overrides", nargs="*", help="method config overrides key=value (e.g. steps=2 lr=1e-3)"
    )


def _model_args(items: list[str]) -> dict[str, Any]:
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--model-arg takes KEY=VALUE, got {item!r}")
        out[key.strip()] = yaml.safe_load(value) if value else None
    return out


def build_service(args: argparse.Namespace) -> Service:
    """The service a ``tta-bench serve`` command line describes (bad input: ValueError)."""
    require_extra()
    from tta_bench.adapter import Adapter

    limits = Limits(
        max_body_bytes=int(args.max_body_mb * 2**20),
        max_image_pixels=args.max_image_pixels,
        max_images=args.max_images,
        max_sessions=args.max_sessions,
        session_idle_s=args.session_idle_s,
        max_pending=args.max_pending,
        workers=args.workers,
        top_k=args.top_k,
    )
    classnames = (
        [c.strip() for c in args.classnames.split(",") if c.strip()] if args.classnames else None
    )
    adapter = Adapter.from_registry(
        args.model,
        _model_args(args.model_arg),
        classnames=classnames,
        templates=args.template,
        dataset=args.dataset,
        method=args.method,
        overrides=list(args.overrides),
        device=args.device,
        seed=args.seed,
    )
    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV)
    if not token and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"tta-bench serve: warning: listening on {args.host} without a token; anyone who "
            f"can reach it can use it (--token or ${TOKEN_ENV})",
            file=sys.stderr,
        )
    return Service(adapter, limits, token=token)


def main(args: argparse.Namespace) -> int:
    """``tta-bench serve``: build the service, serve until Ctrl-C."""
    require_extra()
    from tta_bench import catalog

    try:
        args.method = args.method or catalog.default("method")
        args.model = args.model or catalog.default("model")
    except catalog.NoDefaultError as exc:
        raise ValueError(str(exc)) from None
    if args.classnames is None and args.dataset is None:
        from tta_bench.adapter import default_dataset

        args.dataset = default_dataset(args.model)
        if args.dataset is None:
            raise ValueError("give --dataset NAME or --classnames a,b,c (the classes to predict)")
    service = build_service(args)
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn stopped and re-raised the signal
        serve(service, args.host, args.port, args.log_level)
    print("tta-bench serve: stopped", file=sys.stderr)
    return 0
