"""The harness's version numbers, in a module that imports nothing of the harness (every
module may import it without an import cycle). The distribution's version has one source,
``harness/pyproject.toml``; ``__version__`` reads it from the installed metadata."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("tta-bench")
except PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0+unknown"
#: Version of the results-file schema (``tta_bench.run.schema``).
SCHEMA_VERSION = 2
