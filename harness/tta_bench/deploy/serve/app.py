"""The HTTP app of ``tta-bench serve`` (``create_app``): its routes over a ``Service`` (the
package docstring lists them), the bearer-token guard, and the check that the optional
``serve`` extra (FastAPI, uvicorn, python-multipart) is installed (``require_extra``);
FastAPI is imported only when an app is created."""

# No ``from __future__ import annotations`` here: FastAPI reads the annotations of the
# endpoint closures in ``create_app`` at runtime, where names imported inside the
# function would not resolve from strings.

import asyncio
import contextlib
import hmac
import time
from typing import Any

from tta_bench.deploy.serve.sessions import Service, Session
from tta_bench.deploy.uploads import ClientError, _closing, read_body, split_uploads

__all__ = ["MissingExtraError", "SESSION_HEADER", "create_app", "require_extra"]

SESSION_HEADER = "X-TTA-Session"


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
