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
with the deadlines it lacks, see ``transport._protocol_class``): a request's headers must
arrive within ``header_timeout_s`` of the connection opening or of the previous response
(trickled bytes do not extend it; 408, closed), its body within ``body_timeout_s`` of its
headers (408, closed); a connection with nothing to do is closed after ``keep_alive_s``
without data (uvicorn's ``timeout_keep_alive``, applied from the connection's first byte
on). A client that disconnects mid-upload is one log line.

Limits (4xx answers naming the limit): body size (413, checked from ``Content-Length``
and while reading), images per request (413), pixels per image and decoded pixels per
request (413; every image's header is read before any image is decoded: decompression bombs
never expand, and neither do many bombs in one request), images so elongated that resizing
their shorter side to the model's input would pass the per-image pixel limit (413),
accepted formats (415), open sessions (429), idle sessions (404 after expiry). Images are
decoded and resized one at a time. ``upload_memory_bound`` computes the memory uploads can
take at once from the limits (``/info`` and ``serve --help`` state it). Uploads are never
written to disk: bodies are read into memory and multipart is parsed in memory (Starlette's
form parser spools large files to a temporary file, so it is not used). Every limit is
declared once (``limits.Limits``: its default, range and help; the command's options are
generated from it); a value out of range is refused as every config value is
(``tta_bench.bounds.check_values``: ``serve.workers=0 is out of range: it must be > 0``),
before anything is built.

Auth, failing closed: a bearer token guards every endpoint but ``/health`` (401 without it):
read from ``--token-file`` (its first line) or ``$TTA_BENCH_SERVE_TOKEN``; ``--token`` works
but is visible to every local user in ``ps``. An empty or whitespace token from any source
is refused (exit 2), as is no token at all unless ``--no-auth`` says to serve without one
(``--no-auth`` beside a token is refused too); ``resolve_token`` decides. The API docs
(``/docs``, ``/redoc``, ``/openapi.json``) are off unless ``--api-docs``, and then behind
the token too.

The package by role: ``limits`` (``Limits``, each limit declared once, and
``upload_memory_bound``), ``sessions`` (``Session``, ``Service``), ``app`` (``create_app``
and its routes), ``transport`` (the socket, the deadlines, ``running``, ``serve``), ``cli``
(``add_arguments``, ``resolve_token``, ``build_service``, ``main``). Importing it imports
neither torch nor FastAPI nor uvicorn.
"""

from __future__ import annotations

from tta_bench.deploy.serve.app import (
    SESSION_HEADER,
    MissingExtraError,
    create_app,
    require_extra,
)
from tta_bench.deploy.serve.cli import TOKEN_ENV, add_arguments, build_service, main, resolve_token
from tta_bench.deploy.serve.limits import Limits, limit_options, upload_memory_bound
from tta_bench.deploy.serve.sessions import POLICY, Service, Session
from tta_bench.deploy.serve.transport import check_port, running, serve

__all__ = [
    "Limits",
    "Service",
    "Session",
    "MissingExtraError",
    "create_app",
    "upload_memory_bound",
    "limit_options",
    "resolve_token",
    "build_service",
    "check_port",
    "running",
    "serve",
    "require_extra",
    "add_arguments",
    "main",
    "POLICY",
    "TOKEN_ENV",
    "SESSION_HEADER",
]
