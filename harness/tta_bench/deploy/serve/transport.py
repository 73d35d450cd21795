"""How ``tta-bench serve`` listens: the socket (``_bind``, checked before the model
loads), uvicorn's h11 protocol with the connection deadlines uvicorn lacks
(``_protocol_class``; a raw 408 for a request whose headers are late), and serving until
stopped (``serve``) or from a background thread (``running``). uvicorn and h11 are imported
only when a server is made."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from tta_bench.deploy.serve.app import create_app, require_extra
from tta_bench.deploy.serve.limits import Limits
from tta_bench.deploy.serve.sessions import Service

__all__ = ["check_port", "running", "serve", "startup_line"]

#: The server's log (uvicorn's): one line per misbehaving client, never a traceback.
_log = logging.getLogger("uvicorn.error")
#: How much later than ``body_timeout_s`` the connection-level backstop closes a connection
#: whose body is still incomplete (the endpoint answers 408 first where it reads the body).
_BODY_BACKSTOP_GRACE_S = 2.0


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


class _Deadlines:
    """The deadlines ``_protocol_class`` adds to uvicorn's ``H11Protocol`` (this class comes
    first in its bases, so ``super()`` is uvicorn's; ``loop``, ``transport``, ``conn``,
    ``cycle`` and ``client`` are uvicorn's too). ``header_s`` and ``body_s``: the header
    deadline and the body backstop, in seconds, set by ``_protocol_class``."""

    header_s: float
    body_s: float
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
            self._body_timer = self.loop.call_later(self.body_s, self._body_late)

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
        self._head_timer = self.loop.call_later(self.header_s, self._head_late)

    def _head_late(self) -> None:
        import h11

        self._head_timer = None
        if self.transport.is_closing():
            return
        if self._got_data and self.conn.our_state is h11.IDLE:
            _log.warning(
                "client %s: request headers not received within %g s; answered 408 "
                "(--header-timeout-s)",
                self._peer(),
                self.header_s,
            )
            self.transport.write(
                _raw_408(
                    f"request headers not received within {self.header_s:g} s, the limit "
                    "(--header-timeout-s)"
                )
            )
        self.transport.close()

    def _body_late(self) -> None:
        import h11

        self._body_timer = None
        if not self.transport.is_closing() and self.conn.their_state is h11.SEND_BODY:
            _log.warning(
                "client %s: request body not received within %g s; connection closed "
                "(--body-timeout-s)",
                self._peer(),
                self.body_s,
            )
            self.transport.close()


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
    from uvicorn.protocols.http.h11_impl import H11Protocol

    deadlines = {
        "header_s": limits.header_timeout_s,
        "body_s": limits.body_timeout_s + _BODY_BACKSTOP_GRACE_S,
    }
    return type("GuardedH11Protocol", (_Deadlines, H11Protocol), deadlines)


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


def startup_line(service: Service, url: str) -> str:
    """The line ``serve`` prints once listening: the method, the URL (scripts read it
    from this line), the workers and the auth in force (never the token itself)."""
    if service.token is not None:
        auth = "auth bearer token, required by every endpoint but /health"
    else:
        auth = "auth none (--no-auth): anyone who can reach it can use it"
    return (
        f"tta-bench serve: {service.template.method_name} on {url} "
        f"(workers {service.limits.workers}; {auth}); Ctrl-C stops"
    )


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
    print(startup_line(service, url), flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
