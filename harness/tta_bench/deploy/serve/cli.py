"""The ``tta-bench serve`` command: its options (``add_arguments``; the limit options are
generated from ``Limits``), the bearer token (``resolve_token``), the service a command
line describes (``build_service``) and the command itself (``main``). Imports no torch and
no FastAPI until the service is built."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

from tta_bench.deploy.serve.app import require_extra
from tta_bench.deploy.serve.limits import (
    Limits,
    limit_options,
    limits_from_options,
    upload_memory_bound,
)
from tta_bench.deploy.serve.sessions import Service, check_reset_every
from tta_bench.deploy.serve.transport import _bind, serve

__all__ = ["TOKEN_ENV", "add_arguments", "build_service", "main", "resolve_token"]

TOKEN_ENV = "TTA_BENCH_SERVE_TOKEN"


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

auth fails closed: serve starts only with a token (--token-file PATH,
${TOKEN_ENV} or --token) or with --no-auth (no token: every endpoint open). An
empty token from any source (an empty file, {TOKEN_ENV}= from a failed
$(cat file), --token '') exits 2. The line serve prints once listening says which auth
is in force.

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
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = _help_epilog()
    _add_model_arguments(p)
    _add_access_arguments(p)
    for option in limit_options():  # --workers ... --top-k, from their declaration
        p.add_argument(option.flag, type=option.type, default=option.default, help=option.help)
    p.add_argument("--log-level", default="warning", help="uvicorn log level")
    p.add_argument(
        "overrides", nargs="*", help="method config overrides key=value (e.g. steps=2 lr=1e-3)"
    )


def _add_model_arguments(p: argparse.ArgumentParser) -> None:
    """What is served: the method, the model, the classes, the device and the seed."""
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
    p.add_argument(
        "--session-reset-every",
        type=int,
        default=None,
        metavar="N",
        help="reset a session's adaptation state after every N of its requests (default: "
        "never; POST /sessions/{id}/reset resets on request); the method's own options say "
        "what persists between requests",
    )


def _add_access_arguments(p: argparse.ArgumentParser) -> None:
    """Where it listens and who may use it: the address, the token, the API docs."""
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
    p.add_argument("--port", type=int, default=8000, help="port (0: a free one, printed)")
    p.add_argument(
        "--token-file",
        default=None,
        metavar="PATH",
        help="file whose first line is the bearer token required by every endpoint but "
        f"/health (default: ${TOKEN_ENV}); an empty token from any source exits 2",
    )
    p.add_argument(
        "--token",
        default=None,
        help="the bearer token itself; visible to every local user in ps: prefer --token-file "
        f"or ${TOKEN_ENV}",
    )
    p.add_argument(
        "--no-auth",
        action="store_true",
        help="serve without a token: anyone who can reach the service can use it. Required to "
        "start with no token (serve refuses to otherwise); an error beside --token, "
        f"--token-file or ${TOKEN_ENV}",
    )
    p.add_argument(
        "--api-docs",
        action="store_true",
        help="serve /docs, /redoc and /openapi.json (behind the token; off by default)",
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


def _empty_token(source: str) -> ValueError:
    return ValueError(
        f"empty token from {source}; give the token there (--token-file PATH is recommended), "
        "or pass --no-auth to serve without one"
    )


def resolve_token(
    token: str | None,
    token_file: str | None,
    environ: Mapping[str, str] | None = None,
    *,
    no_auth: bool = False,
) -> str | None:
    """The bearer token, failing closed: the first line of ``token_file``, stripped; else
    ``token`` (from the command line: it works, with a warning on stderr that every local
    user sees it in ``ps``); else ``$TTA_BENCH_SERVE_TOKEN`` of ``environ`` (default
    ``os.environ``). None (no auth) only with ``no_auth`` (``--no-auth``) and no token
    from any source.

    ValueError (the CLI exits 2) naming the source when: a token from any source is empty
    or whitespace (``TTA_BENCH_SERVE_TOKEN=`` from a failed ``$(cat file)`` must not open
    the service); ``token_file`` is missing, unreadable or not text; none is given without
    ``no_auth``; ``no_auth`` is given with a token (``--token``, ``--token-file`` or the
    variable set, even empty); both ``token`` and ``token_file`` are given. A token file
    other users may read is a warning. The token itself is never in a message."""
    env = environ if environ is not None else os.environ
    if token is not None and token_file is not None:
        raise ValueError("give one of --token and --token-file, not both")
    if no_auth:
        given = (
            "--token" if token is not None else "--token-file" if token_file is not None else None
        )
        if given is not None:
            raise ValueError(f"give one of --no-auth and {given}, not both")
        if TOKEN_ENV in env:
            raise ValueError(
                f"--no-auth, but ${TOKEN_ENV} is set; unset it to serve without a token, or "
                "drop --no-auth to use it"
            )
        return None
    if token_file is not None:
        return _token_from_file(token_file)
    if token is not None:
        if not token.strip():
            raise _empty_token("--token")
        logging.getLogger("tta_bench").warning(
            "serve: --token is visible to every local user in ps; put the token in a file "
            f"(--token-file PATH, mode 600) or in ${TOKEN_ENV}"
        )
        return token.strip()
    if TOKEN_ENV in env:
        value = env[TOKEN_ENV].strip()
        if not value:
            raise _empty_token(f"${TOKEN_ENV}")
        return value
    raise ValueError(
        f"no token: give one with --token-file PATH (or ${TOKEN_ENV}), or pass --no-auth to "
        "serve without one (anyone who can reach the service can then use it)"
    )


def _token_from_file(token_file: str) -> str:
    """The first line of ``token_file``, stripped (see ``resolve_token``)."""
    try:
        with open(token_file, encoding="utf-8") as f:
            first = f.readline(4096).strip()
        mode = os.stat(token_file).st_mode
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ValueError(f"cannot read --token-file {token_file}: {reason}") from None
    if not first:
        raise ValueError(
            f"--token-file {token_file}: its first line is empty (an empty token); expected "
            "the token there, or pass --no-auth to serve without one"
        )
    if mode & 0o077:
        logging.getLogger("tta_bench").warning(
            f"serve: --token-file {token_file} is readable by other users (mode "
            f"{mode & 0o777:o}); chmod 600 {token_file}"
        )
    return first


_FROM_ARGS: Any = object()


def build_service(args: argparse.Namespace, token: str | None = _FROM_ARGS) -> Service:
    """The service a ``tta-bench serve`` command line describes (bad input: ValueError);
    ``token`` defaults to ``resolve_token`` of the command line's (``--no-auth`` is needed
    to build one without a token)."""
    require_extra()
    from tta_bench.deploy.adapter import Adapter

    limits = limits_from_options(args)
    check_reset_every(args.session_reset_every)  # before the model is built
    if token is _FROM_ARGS:
        token = resolve_token(args.token, args.token_file, no_auth=args.no_auth)
    classnames = (
        [c.strip() for c in args.classnames.split(",") if c.strip()] if args.classnames else None
    )
    settings = {
        **vars(args),
        "model_args": _model_args(args.model_arg),
        "classnames": classnames,
        "templates": args.template,
        "overrides": list(args.overrides),
    }
    adapter = Adapter.from_settings(argparse.Namespace(**settings))
    if token is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger("tta_bench").warning(
            f"serve: listening on {args.host} with --no-auth; anyone who can reach it can "
            f"use it (--token-file PATH or ${TOKEN_ENV} to require a token)"
        )
    return Service(adapter, limits, token=token, session_reset_every=args.session_reset_every)


def main(args: argparse.Namespace) -> int:
    """``tta-bench serve``: check the limits, the token and the address (bound here, so a
    bad or busy one fails before the model loads), build the service, serve until Ctrl-C."""
    require_extra()
    from tta_bench import catalog

    limits_from_options(args)  # out of range: refused before anything is built
    token = resolve_token(args.token, args.token_file, no_auth=args.no_auth)
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
