"""Where tta-bench keeps caches (pretrained default models, decoded images), and how every
file it writes gets there whole (``atomic_path``)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


def cache_dir() -> Path:
    """The user cache directory: ``$TTA_BENCH_CACHE``, else ``$XDG_CACHE_HOME/tta-bench``,
    else ``~/.cache/tta-bench``. Created on first use."""
    env = os.environ.get("TTA_BENCH_CACHE")
    if env:
        path = Path(env)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        path = Path(base) / "tta-bench"
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def atomic_path(path: str | Path, *, fsync: bool = False) -> Iterator[Path]:
    """A temporary file beside ``path`` to write; when the block exits normally it replaces
    ``path`` in one ``os.replace``, so a reader (or a killed run) sees the old file or the
    new one, never a truncated one. On an exception the temporary file is removed.

    ``fsync=True`` flushes the file to disk before the rename (results files: a power loss
    must not leave an empty file behind the new name). The file gets mode 0644 (``mkstemp``
    creates 0600; results and caches are meant to be shared)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        if fsync:
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: str | Path, text: str, *, fsync: bool = False) -> None:
    """Write ``text`` (UTF-8) to ``path`` through ``atomic_path``."""
    with atomic_path(path, fsync=fsync) as tmp:
        tmp.write_text(text, encoding="utf-8")


class AtomicLog:
    """A text log (JSON lines) that reaches its file only whole: ``write`` collects lines,
    ``flush`` (each finished group or batch) and ``close`` replace the file atomically with
    everything written so far, so a reader or a killed run sees the last flushed log, never
    a torn line. ``append=True`` keeps what the file already holds (a resumed job)."""

    def __init__(self, path: str | Path, *, append: bool = False):
        self.path = Path(path)
        old = self.path.read_text(encoding="utf-8") if append and self.path.is_file() else ""
        self._parts = [old] if old else []
        self._dirty = not append  # a new log replaces the old file even when left empty

    def write(self, text: str) -> int:
        self._parts.append(text)
        self._dirty = True
        return len(text)

    def flush(self) -> None:
        if self._dirty:
            atomic_write_text(self.path, "".join(self._parts))
            self._dirty = False

    def close(self) -> None:
        self.flush()

    def __enter__(self) -> AtomicLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def file_sha256(path: str | Path) -> str:
    """SHA-256 (hex) of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
