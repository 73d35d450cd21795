"""mura_plugin: MuRA (multi-rank test-time adaptation), its baselines, losses, synthetic
shifts, dataset providers and the offline default model, registered with tta-bench through
entry points only. Importing this package is cheap (no torch). Its version has one source,
the root ``pyproject.toml``, read here from the installed metadata."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("mura-plugin")
except PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0+unknown"
