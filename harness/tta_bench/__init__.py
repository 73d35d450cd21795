"""tta-bench: a test-time adaptation benchmark harness for CLIP-style models.

Importing this package is cheap (no torch): the CLI's listing commands rely on it.
The public API lives in the submodules: ``tta_bench.method`` (Method, GradientMethod),
``tta_bench.model`` (ZeroShotClassifier), ``tta_bench.data`` (DomainStream),
``tta_bench.rng`` (SampleGenerator), ``tta_bench.registry`` (the plugin registries).
"""

from __future__ import annotations

from tta_bench import _moved
from tta_bench._version import SCHEMA_VERSION, __version__

_moved.install()  # the modules' import paths from before the rooms (tta_bench._moved)

__all__ = ["evaluate", "Adapter", "SCHEMA_VERSION", "__version__"]


def __getattr__(name: str):
    # Lazy: ``evaluate`` and ``Adapter`` import torch, and importing tta_bench must not.
    if name == "evaluate":
        from tta_bench.api import evaluate

        return evaluate
    if name == "Adapter":
        from tta_bench.deploy.adapter import Adapter

        return Adapter
    raise AttributeError(f"module 'tta_bench' has no attribute {name!r}")
