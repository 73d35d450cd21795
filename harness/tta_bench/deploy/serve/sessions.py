"""The state behind ``tta-bench serve``: the sessions (``Session``) and the service
(``Service``: the shared backbone's adapters, the sessions, the worker pool, the limits),
and the concurrency policy it keeps (``POLICY``, also in ``/info``)."""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import secrets
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tta_bench.deploy.serve.limits import Limits, upload_memory_bound
from tta_bench.deploy.uploads import ACCEPTED_FORMATS, ClientError, check_headers, decode_image

__all__ = ["POLICY", "Session", "Service", "check_reset_every"]

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


def check_reset_every(every: Any) -> int | None:
    """The reset policy ``session_reset_every``: a positive integer (requests) or None
    (never); anything else is a ``ValueError`` naming the value."""
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ValueError(
            f"session_reset_every (--session-reset-every) must be a positive integer "
            f"(requests) or None (never), got {every!r}"
        )
    return every


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

    def __init__(
        self,
        adapter: Any,
        limits: Limits | None = None,
        *,
        token: str | None = None,
        session_reset_every: int | None = None,
    ):
        """``token``: the bearer token every endpoint but ``/health`` requires, or None for
        none (the command line needs ``--no-auth`` for that). An empty or whitespace token
        is a ``ValueError``, never read as no auth; the token is used stripped.
        ``session_reset_every``: the service's reset policy, a session's adaptation state
        is reset after every N of its requests (None: only on ``POST
        /sessions/{id}/reset``); a positive integer, else a ``ValueError`` naming it."""
        self.session_reset_every = check_reset_every(session_reset_every)
        if token is not None and (not isinstance(token, str) or not token.strip()):
            shown = "an empty token" if isinstance(token, str) else f"a {type(token).__name__}"
            raise ValueError(
                f"empty token: Service(token=...) got {shown}; expected a non-empty string, "
                "or None to serve without a token (--no-auth)"
            )
        self.limits = limits or Limits()
        self.token = token.strip() if token is not None else None
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
        limit = self.limits.max_image_pixels  # the service's, not the adapter's default
        return torch.cat(
            [
                self.template.preprocess([decode_image(n, d, limit)], max_pixels=limit)
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

    def _in_session(self, s: Session, x: Any) -> tuple[Any, bool]:
        """The session's prediction, then the reset policy: whether it reset the session
        (after every ``session_reset_every``-th request since the last reset)."""
        with s.thread_lock:
            pred = s.adapter(x)
            every = self.session_reset_every
            if every is not None and s.requests + 1 >= every:
                s.adapter.reset()
                return pred, True
            return pred, False

    async def predict(self, uploads: list[tuple[str, bytes]], sid: str | None, k: int) -> dict:
        s = self.session(sid) if sid is not None else None
        was_reset = False
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
                    pred, was_reset = await self.run(self._in_session, s, x)
                    s.requests = 0 if was_reset else s.requests + 1
            finally:
                s.busy -= 1
                s.last_used = time.monotonic()
        seconds = time.perf_counter() - start
        rows = pred.records(k)
        out = {
            "session": sid,
            "method": self.template.method_name,
            "loss": pred.loss,
            "seconds": seconds,
            "predictions": [{"file": name, **row} for (name, _), row in zip(uploads, rows)],
        }
        if s is not None:  # the reset policy reset the session after this request
            out["session_reset"] = was_reset
        return out

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
                "reset_every_requests": self.session_reset_every,
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
