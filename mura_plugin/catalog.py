"""Points tta-bench at this distribution's catalogue (``registry.yaml``, shipped in the wheel).
Imported when tta-bench lists components, so it must stay free of heavy imports."""

from pathlib import Path

CATALOG_PATH = str(Path(__file__).with_name("registry.yaml"))
