"""The harness's own test plugin: a tiny CLIP-like model, synthetic and image-folder datasets,
two shifts, a loss and a few methods, registered through the real ``tta_bench.*`` entry points
(``../tta_bench_testplugin-0.1.dist-info``) so the harness is tested without ``mura_plugin``.

Everything is small (16 px images, about 2,100 parameters) and deterministic. Some methods
are instruments for the tests (``spy``, ``diverge``, ``needs_source``, ``sleepy``); their
docstrings say what they observe or provoke.
"""

from __future__ import annotations

from pathlib import Path

CATALOG_PATH = str(Path(__file__).with_name("registry.yaml"))
