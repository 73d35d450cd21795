"""Synthetic shifts (corruptions) as batched torch kernels.

Contract (tta_bench.shifts): ``kernel(images, severity, *, generator, table) -> images``
with ``images`` float ``[B, C, H, W]`` in [0, 1] on any device, ``severity`` an int in
1..5, ``generator`` a ``tta_bench.rng.SampleGenerator`` (row i's randomness comes from
sample i's generator only, so a sample's corruption does not depend on the batch it is in)
and ``table`` the severity parameter table named by the protocol:

* ``cifar``    - CIFAR-10-C / CIFAR-100-C parameters (32 px), Hendrycks & Dietterich 2019;
* ``imagenet`` - ImageNet-C parameters (224 px);
* ``digits``   - the embedded default's table (32 px; the digits suites' protocol version 2),
  calibrated on the shipped default model by ``benchmarks/calibrate_digits.py``: per
  corruption, zero-shot accuracy falls evenly from clean to about 55% of clean at severity
  5 (the published CLIP ViT-B/16 CIFAR-10-C anchor keeps ~64%), so every cell carries
  signal (none near chance) and accuracy falls with severity. The digits are upscaled 8x8
  glyphs, far more robust to CIFAR-strength blur and noise than natural images, hence
  stronger parameters than ``cifar``. jpeg_compression (quality 2 still keeps 91%),
  saturate and grayscale (grey digits) cannot reach the target; pixelate's integer target
  side makes accuracy jump (4 px: 20%), so its severity 5 stops at 6 px (76%).

Modules: ``noise`` (gaussian/shot/impulse/speckle noise), ``blur`` (gaussian, defocus,
glass, motion, zoom), ``weather`` (snow, frost, fog, spatter), ``digital`` (brightness,
contrast, saturate, jpeg_compression, pixelate, color_jitter, grayscale), ``geometric``
(elastic_transform, rotation).

The tables are data, ``severities.json`` beside these modules (read once by
``_params.severity_table``); each kernel module binds its tables to constants (e.g.
``blur.GLASS_BLUR``) and says there what each parameter means.

Other image sizes: every parameter measured in pixels (blur sigmas and radii, glass-blur
displacement, motion-blur length, snow grain zoom, frost texture scale, spatter liquid blur,
elastic displacement, smoothing and affine jitter) is multiplied by
``min(H, W) / native`` where ``native`` is the chosen table's size (32 for ``cifar`` and
``digits``, 224 for ``imagenet``); see ``_params.spatial_scale``. At the native size the
table is used verbatim. Relative parameters (noise levels, zoom factors, JPEG quality,
pixelate factor, colour factors, angles) are size-independent. Pick the table whose native
size is nearer to the data (the protocol names it; nothing is guessed).

Frost textures are synthesised deterministically (``weather.frost_texture``), matched to
the per-channel statistics of the reference photographs; nothing is downloaded.
"""
