"""Deployment: the standalone ``Adapter``, the ``predict`` batch job and the ``serve``
HTTP service, over the same methods as the benchmark.

``DEFAULT_MAX_PIXELS`` is the one declaration of the per-image pixel budget of image
files decoded outside the benchmark: the ``predict`` job key ``max_pixels`` defaults to
it, and so does ``Adapter.max_pixels`` (``tta-bench serve`` hands its adapter the
images it has decoded under its own, tighter ``--max-image-pixels``, and that limit
along with them). Checked from an image's header before any pixel is decoded."""

from __future__ import annotations

__all__ = ["DEFAULT_MAX_PIXELS"]

#: The default per-image pixel budget: 40 megapixels, 120 MB as RGB.
DEFAULT_MAX_PIXELS = 40_000_000
