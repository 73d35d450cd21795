"""Hydra config package of mura_plugin (named method presets under ``method/``), put on
tta-bench's search path through the ``tta_bench.configs`` entry point."""
