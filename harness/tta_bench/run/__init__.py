"""Running a benchmark: protocols and streams, the data pipeline, the evaluation loop,
its bookkeeping (costs, resume, results, per-sample outputs, shards) and run construction."""
