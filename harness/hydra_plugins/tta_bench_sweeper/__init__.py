"""tta-bench's Hydra plugin: the sweeper of ``tta-bench sweep`` (``tta_bench.run.sweep``)."""
