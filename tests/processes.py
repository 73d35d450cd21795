"""What tests share for running code in a new process: ``python_ok``, a snippet in a fresh
interpreter that must succeed; ``serve_cli``, ``tta-bench serve`` in a subprocess with the
address its first line announces; and what they share for not starting one:
``run_on_one_thread`` and ``sweep_on_one_thread``, ``tta-bench run`` and ``tta-bench
sweep`` (Hydra's basic launcher) in this process as a one-CPU job would run them;
``on_sys_path``, this process with a package folder first on ``sys.path``, as a new
interpreter with it on ``PYTHONPATH``; and ``collections_of_new_objects_only``, for code
that calls ``gc.collect()`` inside a test process."""

from __future__ import annotations

import contextlib
import gc
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def collections_of_new_objects_only() -> Iterator[None]:
    """Inside, the garbage collector leaves alone every object that existed before
    (``gc.freeze``): code that frees each model with ``gc.collect()`` (the GPU check's
    methods, the model families) then scans what it made, not the whole heap of a pytest
    worker (torch, every collected test) at each call. What is collected inside, and
    when, is otherwise unchanged; the older objects are scanned again after it. Import
    what the code inside will import before entering: modules imported inside are new
    objects too (open_clip with timm and torchvision: hundreds of thousands)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def on_sys_path(folder: Path, env: dict[str, str | None]) -> Iterator[None]:
    """This process with ``folder`` first on ``sys.path`` and ``env`` set (``None``: unset),
    the registries scanned again on entry and on exit: what an interpreter started with
    ``folder`` on ``PYTHONPATH`` and that environment finds (the plugins under it and their
    entry points). ``sys.path``, the environment and the registries are restored after."""
    import pytest

    from tta_bench.registry import reset_registries

    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(folder))
        for key, value in env.items():
            if value is None:
                mp.delenv(key, raising=False)
            else:
                mp.setenv(key, value)
        reset_registries()
        try:
            yield
        finally:
            mp.undo()
            reset_registries()


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """torch on one thread inside, as a one-CPU job runs; the caller's count after (also
    where a sweep job set its own)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run_on_one_thread(*args: str) -> None:
    """``tta-bench run ARGS`` (the CLI's own ``main``) in this process on one torch thread,
    as a sweep job or an array task with one CPU runs it, asserted to exit 0: the reference
    their results must equal bit for bit, without another interpreter's start-up."""
    from tta_bench.cli import main

    with _one_torch_thread():
        assert main(["run", *args]) == 0


def sweep_on_one_thread(*args: str) -> str:
    """``tta-bench sweep ARGS`` in this process, on one torch thread, asserted to exit 0;
    what it printed (its job lines and Hydra's log). Hydra's basic launcher runs every job
    here, as a sweep's own process would; what Hydra's job logging changes (the root
    logger's handlers and level) and the thread count a job sets are restored after it."""
    import io
    import logging

    from tta_bench.cli import main

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    printed = io.StringIO()
    try:
        with _one_torch_thread(), contextlib.redirect_stdout(printed):
            code = main(["sweep", *args])
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    assert code == 0, printed.getvalue()[-3000:]
    return printed.getvalue()


def python_ok(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` run by ``python -c`` in a fresh interpreter (text output captured), asserted
    to exit 0 (its stderr as the message); the completed process."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done


@contextlib.contextmanager
def serve_cli(*args: str, env: dict[str, str]) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``tta-bench serve --port 0 *args`` (the CLI module under this interpreter) in a
    subprocess with environment ``env`` and text pipes. ``args`` name the auth: a token
    (``--token-file PATH``, or ``TTA_BENCH_SERVE_TOKEN`` in ``env``) or ``--no-auth`` (with
    the variable not in ``env``); serve refuses to start without one. Yields the process and
    the base URL its first line announces (asserted there; else its stderr is the message).
    On exit a process still running is killed; its pipes are closed."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tta_bench.cli", "serve", "--port", "0", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:\d+", line)
        assert match, line + proc.stderr.read()
        yield proc, match.group(0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
