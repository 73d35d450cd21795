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
pooled sessionless instance, is an ``Adapter.spawn()`` of it (``tta_bench.deploy.adapter``):
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
* a predict request is admitted only once its whole body has arrived: at most
  ``max_pending`` admitted at once (waiting or computing); the next one gets 503 with
  ``Retry-After``. Bodies still arriving hold no admission slot: their bytes count, as they
  arrive, against ``max_reading_bytes`` (503 beyond), so a slow client never locks others out.

Deadlines (a hostile client holds a connection for a bounded time; uvicorn's h11 protocol
with the deadlines it lacks, see ``_protocol_class``): a request's headers must arrive within
``header_timeout_s`` of the connection opening or of the previous response (trickled bytes do
not extend it; 408, closed), its body within ``body_timeout_s`` of its headers (408, closed);
a connection with nothing to do is closed after ``keep_alive_s`` without data (uvicorn's
``timeout_keep_alive``, applied from the connection's first byte on). A client that
disconnects mid-upload is one log line.

Limits (4xx answers naming the limit): body size (413, checked from ``Content-Length``
and while reading), images per request (413), pixels per image and decoded pixels per
request (413; every image's header is read before any image is decoded: decompression bombs
never expand, and neither do many bombs in one request), images so elongated that resizing
their shorter side to the model's input would pass the per-image pixel limit (413),
accepted formats (415), open sessions (429), idle sessions (404 after expiry). Images are
decoded and resized one at a time. ``upload_memory_bound`` computes the memory uploads can
take at once from the limits (``/info`` and ``serve --help`` state it). Uploads are never
written to disk: bodies are read into memory and multipart is parsed in memory (Starlette's
form parser spools large files to a temporary file, so it is not used).

Auth: an optional bearer token guards every endpoint but ``/health`` (401 without it): read
from ``--token-file`` (its first line) or ``$TTA_BENCH_SERVE_TOKEN``; ``--token`` works but is
visible to every local user in ``ps``. The API docs (``/docs``, ``/redoc``,
``/openapi.json``) are off unless ``--api-docs``, and then behind the token too.
"""

# No ``from __future__ import annotations`` here: FastAPI reads the annotations of the
# endpoint closures in ``create_app`` at runtime, where names imported inside the
# function would not resolve from strings.

import argparse
import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import os
import queue
import secrets
import socket
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tta_bench.deploy.uploads import (
    ACCEPTED_FORMATS,
    ClientError,
    _closing,
    check_headers,
    decode_image,
    read_body,
    split_uploads,
)

__all__ = [
    "Limits",
    "Service",
    "MissingExtraError",
    "create_app",
    "upload_memory_bound",
    "resolve_token",
    "running",
    "serve",
    "require_extra",
    "add_arguments",
    "main",
    "POLICY",
    "TOKEN_ENV",
    "SESSION_HEADER",
]

TOKEN_ENV = "TTA_BENCH_SERVE_TOKEN"
SESSION_HEADER = "X-TTA-Session"
POLICY = (
    "at most `workers` requests compute at once (a thread pool); the event loop never "
    "adapts, so /health, /info and session management answer while adaptations run; one "
    "request at a time per session, in arrival order (per-session lock, no worker held "
    "while waiting); sessionless requests use one of `workers` pooled adapters, reset after "
    "each request; a predict request is admitted once its whole body has arrived, at most "
    "`max_pending` at once (503 beyond); bodies still arriving hold no slot, their bytes count "
    "against `max_reading_bytes` as they arrive (503 beyond) and must arrive within "
    "`body_timeout_s` (408)"
)
#: The server's log (uvicorn's): one line per misbehaving client, never a traceback.
_log = logging.getLogger("uvicorn.error")
#: How much later than ``body_timeout_s`` the connection-level backstop closes a connection
#: whose body is still incomplete (the endpoint answers 408 first where it reads the body).
_BODY_BACKSTOP_GRACE_S = 2.0


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
    """What one service accepts and how long it waits for a client (see the module
    docstring); every field must be a positive number (ValueError naming it otherwise).

    ``max_request_pixels``: decoded pixels of all the images of one request, summed from
    their headers before any is decoded. ``max_reading_bytes``: bytes of request bodies
    being received at once, over all connections, counted as they arrive.
    ``header_timeout_s``: from a connection's opening (or its previous response) to the end
    of the request's headers. ``body_timeout_s``: from the request's headers to the end of
    its body. ``keep_alive_s``: a connection without data for this long is closed
    (uvicorn's ``timeout_keep_alive``; or after ``header_timeout_s``, if that is shorter)."""

    max_body_bytes: int = 16 << 20
    max_image_pixels: int = 16_000_000
    max_images: int = 64
    max_sessions: int = 64
    session_idle_s: float = 600.0
    max_pending: int = 32
    workers: int = 2
    top_k: int = 5
    max_request_pixels: int = 64_000_000
    max_reading_bytes: int = 256 << 20
    header_timeout_s: float = 10.0
    body_timeout_s: float = 10.0
    keep_alive_s: float = 5.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"limit {f.name} must be a positive number, got {value!r}")
        if self.max_reading_bytes < self.max_body_bytes:
            raise ValueError(
                f"limit max_reading_bytes ({self.max_reading_bytes}, --max-reading-mb) must be "
                f"at least max_body_bytes ({self.max_body_bytes}, --max-body-mb): a whole body "
                "must fit in what may be received at once"
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
        self.pending = 0  # admitted predict requests (their whole body arrived)
        self.reading = 0  # predict requests whose body is arriving
        self.reading_bytes = 0  # bytes those have received so far
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
        """The request's input batch: every image's header checked first
        (``check_headers``), then each image decoded and resized on its own, so a worker
        holds one full-size image at a time (see ``upload_memory_bound``)."""
        import torch

        check_headers(uploads, self.limits, self.template.image_size)
        return torch.cat(
            [
                self.template.preprocess([decode_image(n, d, self.limits.max_image_pixels)])
                for n, d in uploads
            ]
        )

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
            "load": {
                "pending": self.pending,
                "computing": self.computing,
                "reading": self.reading,
                "reading_bytes": self.reading_bytes,
            },
            "memory": {
                **self.memory,
                "uploads_worst_case_bytes": upload_memory_bound(self.limits, t.image_size),
            },
            "uptime_s": time.time() - self.started,
        }

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


# -- the HTTP app ------------------------------------------------------------------------------
def create_app(service: Service, *, api_docs: bool = False) -> Any:
    """The FastAPI app of ``service`` (see the module docstring for the endpoints). The
    API docs (``/docs``, ``/redoc``, ``/openapi.json``) only with ``api_docs``, and then
    behind the token like every endpoint but ``/health``."""
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

    app = FastAPI(
        title="tta-bench",
        description="Test-time adaptation service",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )

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
    if api_docs:
        _add_docs_routes(app, guarded)
    return app


def _add_docs_routes(app: Any, guarded: list[Any]) -> None:
    """``/openapi.json``, ``/docs`` (Swagger UI) and ``/redoc``, behind the token. The pages
    fetch ``/openapi.json`` from the browser, which sends no bearer token by itself: with a
    token, read them through something that adds the header (curl, a proxy)."""
    from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
    from fastapi.responses import HTMLResponse, JSONResponse

    @app.get("/openapi.json", dependencies=guarded, include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", dependencies=guarded, include_in_schema=False)
    async def swagger() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="tta-bench - API docs")

    @app.get("/redoc", dependencies=guarded, include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url="/openapi.json", title="tta-bench - API docs")


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
            _closing({"WWW-Authenticate": "Bearer"}),  # any body it sent is not read
        )


async def _predict(service: Service, request: Any, session: str | None, top_k: int | None):
    """``POST /predict``: the body is read in memory first (``read_body``: its deadline and
    byte limits; a refusal there closes the connection), then the request is checked
    (session names, top_k, the session exists): answering those before the body was read
    would close the connection under a client still sending, which sees a reset instead of
    the answer. Only a request whose whole body has arrived is admitted (the pending limit,
    503 beyond), split and predicted."""
    body = await read_body(request, service)  # its refusals carry Connection: close
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
    if sid is not None:
        service.session(sid)  # unknown or expired: 404
    if service.pending >= service.limits.max_pending:
        raise ClientError(
            503,
            f"busy: {service.pending} requests in progress, the limit (--max-pending); "
            "retry shortly",
            {"Retry-After": "1"},
        )
    service.pending += 1
    try:
        uploads = split_uploads(
            body, request.headers.get("content-type", ""), service.limits.max_images
        )
        del body  # the parts are copies (multipart) or the body itself (raw)
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
def check_port(port: int) -> None:
    """ValueError naming ``port`` unless it is a TCP port number (0: a free one)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"--port {port!r} is not a TCP port: expected 0..65535 (0: a free one)")


def _bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port``, not yet listening (connections are refused until
    ``listen``); ValueError naming both when the port is no port or the address cannot be
    had (an unknown host, a port in use, no permission)."""
    check_port(port)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except (OSError, OverflowError) as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} (--host, --port): {exc}") from None
    sock.set_inheritable(True)
    return sock


def _raw_408(detail: str) -> bytes:
    body = json.dumps({"detail": detail}).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


def _protocol_class(limits: Limits) -> type:
    """uvicorn's h11 HTTP protocol with the connection deadlines uvicorn lacks (it times out
    only idle keep-alive connections, after a response, and any byte resets that):

    * a request's headers must have arrived ``header_timeout_s`` after the connection
      opened or its previous response was sent, however slowly they trickle in; a client
      that sent part of them gets a 408 then, any other connection is closed;
    * a request's body must have arrived ``body_timeout_s`` (plus a grace of
      ``_BODY_BACKSTOP_GRACE_S``) after its headers, whether or not the endpoint reads it:
      ``/predict`` answers 408 itself at ``body_timeout_s``; this closes the rest;
    * a new connection without data is closed after ``keep_alive_s``, as uvicorn closes an
      idle keep-alive one.

    Always this protocol (h11), never httptools even where it is installed."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    header_s = limits.header_timeout_s
    body_s = limits.body_timeout_s + _BODY_BACKSTOP_GRACE_S

    class GuardedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        _body_timer: asyncio.TimerHandle | None = None
        _got_data = False  # bytes arrived since the header deadline was set

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_head()
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

        def data_received(self, data: bytes) -> None:
            self._got_data = True
            super().data_received(data)

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a new request's headers have arrived
                self._cancel("_head_timer")
                self._cancel("_body_timer")
                self._body_timer = self.loop.call_later(body_s, self._body_late)

        def on_response_complete(self) -> None:
            if not self.transport.is_closing():
                self._arm_head()  # before: a pipelined request may start in there
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel("_head_timer")
            self._cancel("_body_timer")
            super().connection_lost(exc)

        def _cancel(self, name: str) -> None:
            timer = getattr(self, name)
            if timer is not None:
                timer.cancel()
                setattr(self, name, None)

        def _peer(self) -> str:
            return f"{self.client[0]}:{self.client[1]}" if self.client else "(unknown client)"

        def _arm_head(self) -> None:
            self._cancel("_head_timer")
            self._got_data = False
            self._head_timer = self.loop.call_later(header_s, self._head_late)

        def _head_late(self) -> None:
            self._head_timer = None
            if self.transport.is_closing():
                return
            if self._got_data and self.conn.our_state is h11.IDLE:
                _log.warning(
                    "client %s: request headers not received within %g s; answered 408 "
                    "(--header-timeout-s)",
                    self._peer(),
                    header_s,
                )
                self.transport.write(
                    _raw_408(
                        f"request headers not received within {header_s:g} s, the limit "
                        "(--header-timeout-s)"
                    )
                )
            self.transport.close()

        def _body_late(self) -> None:
            self._body_timer = None
            if not self.transport.is_closing() and self.conn.their_state is h11.SEND_BODY:
                _log.warning(
                    "client %s: request body not received within %g s; connection closed "
                    "(--body-timeout-s)",
                    self._peer(),
                    body_s,
                )
                self.transport.close()

    return GuardedH11Protocol


def _server(service: Service, log_level: str, api_docs: bool) -> Any:
    import uvicorn

    config = uvicorn.Config(
        create_app(service, api_docs=api_docs),
        log_level=log_level,
        lifespan="on",
        http=_protocol_class(service.limits),
        timeout_keep_alive=service.limits.keep_alive_s,  # type: ignore[arg-type]
        ws="none",  # no websocket endpoints: an upgrade request is plain HTTP here
    )
    return uvicorn.Server(config)


@contextlib.contextmanager
def running(
    service: Service, host: str = "127.0.0.1", port: int = 0, *, api_docs: bool = False
) -> Iterator[str]:
    """Serve ``service`` from a background thread (tests, notebooks); yields the base URL
    and stops the server when the block exits. ``port=0``: a free port."""
    sock = _bind(host, port)
    sock.listen(128)
    url = f"http://{host}:{sock.getsockname()[1]}"
    server = _server(service, "warning", api_docs)
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
    service: Service,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "warning",
    *,
    sock: socket.socket | None = None,
    api_docs: bool = False,
) -> None:
    """Serve until Ctrl-C (SIGINT) or SIGTERM; prints the URL once listening. ``sock``: a
    socket already bound (``_bind``), so that a bad address fails before the model loads."""
    require_extra()
    sock = sock if sock is not None else _bind(host, port)
    sock.listen(128)
    url = f"http://{host}:{sock.getsockname()[1]}"
    server = _server(service, log_level, api_docs)
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
def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def _help_epilog() -> str:
    """``serve --help``'s closing text: the recommended token setup and the worst-case
    memory of uploads under the default limits (``upload_memory_bound``)."""
    d = Limits()
    small, large = upload_memory_bound(d, 32), upload_memory_bound(d, 224)
    return f"""\
example (the token from a file, never on the command line, where every local user sees it
in ps):
  umask 077; python -c 'import secrets; print(secrets.token_urlsafe(32))' > serve.token
  tta-bench serve --method NAME --host 0.0.0.0 --token-file serve.token

deadlines: a request's headers must arrive within --header-timeout-s of the connection
opening (or of its previous response), its body within --body-timeout-s of its headers
(408 and the connection closed beyond, so a slow client holds nothing for longer); a
connection without data is closed after --keep-alive-s. A predict request is admitted
(--max-pending) only once its whole body has arrived.

worst-case memory of uploads with the default limits (computed from them, not measured;
beyond the model, the sessions and the method's activations; /info states it for the
model served):
  bodies being received   --max-reading-mb                    {_mib(small["receiving"]):>9}
  admitted bodies         (--max-pending + 1) x --max-body-mb {_mib(small["admitted"]):>9}
  decoding                --workers x 3 x --max-image-pixels
                          x 4 B (one image at a time, 3 full-size
                          copies at PIL's 4 bytes per pixel)  {_mib(small["decoding"]):>9}
  input batches           --workers x --max-images x 3 x S^2
                          x 8 B (S: the model's input size)   {_mib(small["batches"]):>9} at S=32
  total                                                       {_mib(small["total"]):>9} at S=32,
                                                              {_mib(large["total"]):>9} at S=224
--max-request-pixels bounds the decoding work of one request; every image's header is
checked against it and --max-image-pixels before any image is decoded.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``tta-bench serve`` options (the CLI calls this; no heavy imports)."""
    d = Limits()
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = _help_epilog()
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
        "--token-file",
        default=None,
        metavar="PATH",
        help="file whose first line is the bearer token required by every endpoint but "
        f"/health (default: ${TOKEN_ENV}; neither: no auth)",
    )
    p.add_argument(
        "--token",
        default=None,
        help="the bearer token itself; visible to every local user in ps: prefer --token-file "
        f"or ${TOKEN_ENV}",
    )
    p.add_argument(
        "--api-docs",
        action="store_true",
        help="serve /docs, /redoc and /openapi.json (behind the token; off by default)",
    )
    p.add_argument(
        "--workers", type=int, default=d.workers, help="requests computing at once (%(default)s)"
    )
    p.add_argument(
        "--max-pending",
        type=int,
        default=d.max_pending,
        help="requests admitted at once, each once its body has arrived (%(default)s)",
    )
    p.add_argument(
        "--max-body-mb",
        type=float,
        default=d.max_body_bytes / 2**20,
        help="request body limit (%(default)g MiB)",
    )
    p.add_argument(
        "--max-reading-mb",
        type=float,
        default=d.max_reading_bytes / 2**20,
        help="bytes of bodies being received at once, all connections (%(default)g MiB)",
    )
    p.add_argument(
        "--max-image-pixels",
        type=int,
        default=d.max_image_pixels,
        help="pixels per image (%(default)s)",
    )
    p.add_argument(
        "--max-request-pixels",
        type=int,
        default=d.max_request_pixels,
        help="decoded pixels per request, all its images (%(default)s)",
    )
    p.add_argument(
        "--max-images", type=int, default=d.max_images, help="images per request (%(default)s)"
    )
    p.add_argument(
        "--max-sessions", type=int, default=d.max_sessions, help="open sessions (%(default)s)"
    )
    p.add_argument(
        "--session-idle-s",
        type=float,
        default=d.session_idle_s,
        help="idle session timeout (%(default)g s)",
    )
    p.add_argument(
        "--header-timeout-s",
        type=float,
        default=d.header_timeout_s,
        help="time to send a request's headers (%(default)g s)",
    )
    p.add_argument(
        "--body-timeout-s",
        type=float,
        default=d.body_timeout_s,
        help="time to send a request's body, after its headers (%(default)g s)",
    )
    p.add_argument(
        "--keep-alive-s",
        type=float,
        default=d.keep_alive_s,
        help="a connection without data is closed after this (%(default)g s)",
    )
    p.add_argument(
        "--top-k", type=int, default=d.top_k, help="classes listed per image (%(default)s)"
    )
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


def resolve_token(
    token: str | None, token_file: str | None, environ: Mapping[str, str] | None = None
) -> str | None:
    """The bearer token: the first line of ``token_file``, stripped; else ``token`` (from
    the command line: it works, with a warning on stderr that every local user sees it in
    ``ps``); else ``$TTA_BENCH_SERVE_TOKEN`` of ``environ`` (default ``os.environ``); None
    (no auth) when none is given or it is empty. ValueError naming the file when it is
    missing, unreadable, not text, or its first line is empty, and when both ``token`` and
    ``token_file`` are given. A token file other users may read is a warning."""
    if token is not None and token_file is not None:
        raise ValueError("give one of --token and --token-file, not both")
    if token_file is not None:
        try:
            with open(token_file, encoding="utf-8") as f:
                first = f.readline(4096).strip()
            mode = os.stat(token_file).st_mode
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise ValueError(f"cannot read --token-file {token_file}: {reason}") from None
        if not first:
            raise ValueError(
                f"--token-file {token_file}: its first line is empty; expected the token there"
            )
        if mode & 0o077:
            logging.getLogger("tta_bench").warning(
                f"serve: --token-file {token_file} is readable by other users (mode "
                f"{mode & 0o777:o}); chmod 600 {token_file}"
            )
        return first
    if token is not None:
        logging.getLogger("tta_bench").warning(
            "serve: --token is visible to every local user in ps; put the token in a file "
            f"(--token-file PATH, mode 600) or in ${TOKEN_ENV}"
        )
        return token or None
    return (environ if environ is not None else os.environ).get(TOKEN_ENV) or None


def _limits(args: argparse.Namespace) -> Limits:
    """The limits a ``tta-bench serve`` command line sets (ValueError naming a bad one)."""
    return Limits(
        max_body_bytes=int(args.max_body_mb * 2**20),
        max_image_pixels=args.max_image_pixels,
        max_images=args.max_images,
        max_sessions=args.max_sessions,
        session_idle_s=args.session_idle_s,
        max_pending=args.max_pending,
        workers=args.workers,
        top_k=args.top_k,
        max_request_pixels=args.max_request_pixels,
        max_reading_bytes=int(args.max_reading_mb * 2**20),
        header_timeout_s=args.header_timeout_s,
        body_timeout_s=args.body_timeout_s,
        keep_alive_s=args.keep_alive_s,
    )


_FROM_ARGS: Any = object()


def build_service(args: argparse.Namespace, token: str | None = _FROM_ARGS) -> Service:
    """The service a ``tta-bench serve`` command line describes (bad input: ValueError);
    ``token`` defaults to ``resolve_token`` of the command line's."""
    require_extra()
    from tta_bench.deploy.adapter import Adapter

    limits = _limits(args)
    if token is _FROM_ARGS:
        token = resolve_token(args.token, args.token_file)
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
    if not token and args.host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger("tta_bench").warning(
            f"serve: listening on {args.host} without a token; anyone who can reach it can "
            f"use it (--token-file PATH or ${TOKEN_ENV})"
        )
    return Service(adapter, limits, token=token)


def main(args: argparse.Namespace) -> int:
    """``tta-bench serve``: check the limits, the token and the address (bound here, so a
    bad or busy one fails before the model loads), build the service, serve until Ctrl-C."""
    require_extra()
    from tta_bench import catalog

    _limits(args)
    token = resolve_token(args.token, args.token_file)
    sock = _bind(args.host, args.port)
    try:
        try:
            args.method = args.method or catalog.default("method")
            args.model = args.model or catalog.default("model")
        except catalog.NoDefaultError as exc:
            raise ValueError(str(exc)) from None
        if args.classnames is None and args.dataset is None:
            from tta_bench.deploy.adapter import default_dataset

            args.dataset = default_dataset(args.model)
            if args.dataset is None:
                raise ValueError(
                    "give --dataset NAME or --classnames a,b,c (the classes to predict)"
                )
        service = build_service(args, token)
        with contextlib.suppress(KeyboardInterrupt):  # uvicorn stopped and re-raised it
            serve(service, args.host, args.port, args.log_level, sock=sock, api_docs=args.api_docs)
    finally:
        sock.close()
    print("tta-bench serve: stopped", file=sys.stderr)
    return 0
