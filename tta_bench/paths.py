"""Where tta-bench keeps caches (pretrained default models, decoded images)."""

from __future__ import annotations

import os
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
