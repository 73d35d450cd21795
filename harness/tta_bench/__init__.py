"""tta-bench: a test-time adaptation benchmark harness for CLIP-style models.

Importing this package is cheap (no torch): the CLI's listing commands rely on it.
The public API lives in the submodules: ``tta_bench.method`` (Method, GradientMethod),
``tta_bench.model`` (ZeroShotClassifier), ``tta_bench.data`` (DomainStream),
``tta_bench.rng`` (SampleGenerator), ``tta_bench.registry`` (the plugin registries).
"""

from __future__ import annotations

__version__ = "0.1.0"
SCHEMA_VERSION = 1
