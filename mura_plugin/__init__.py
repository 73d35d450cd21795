"""mura_plugin: MuRA (multi-rank test-time adaptation), its baselines, losses, synthetic
shifts, dataset providers and the offline default model, registered with tta-bench through
entry points only. Importing this package is cheap (no torch)."""

__version__ = "0.1.0"
