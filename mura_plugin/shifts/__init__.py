"""Synthetic shifts (corruptions) as batched torch kernels.

Contract (tta_bench.shifts): ``kernel(images, severity, *, generator, table) -> images``
with ``images`` float ``[B, C, H, W]`` in [0, 1] on any device, ``severity`` in 1..5,
``generator`` a ``tta_bench.rng.SampleGenerator`` (row i's randomness comes from sample i's
generator only) and ``table`` the severity parameter table named by the protocol:

* ``cifar``    - CIFAR-10-C / CIFAR-100-C parameters (32 px), Hendrycks & Dietterich 2019;
* ``imagenet`` - ImageNet-C parameters (224 px);
* ``digits``   - the embedded default's table, calibrated on the 32 px upscaled digits so
  that severity 5 at least halves zero-shot accuracy where the shift can (the digits are
  upscaled 8x8 glyphs, far more robust to CIFAR-strength noise than natural images).
"""
