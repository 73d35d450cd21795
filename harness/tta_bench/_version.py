"""The harness's version numbers, in a module that imports nothing (every module may
import it without an import cycle)."""

__version__ = "0.2.0"
#: Version of the results-file schema (``tta_bench.schema``).
SCHEMA_VERSION = 2
