"""The sweeper of ``tta-bench sweep``: Hydra's basic sweeper, with light jobs packed.

Before each batch of jobs goes to the launcher, ``tta_bench.run.sweep.pack_jobs`` folds the
light jobs (``Method.light``: one forward pass per sample, no backward) that differ only
in method and seeds into tasks of up to ``pack`` jobs; the plan is written to
``<sweep dir>/jobs/packs.json``, where each task reads the jobs packed into it. Hydra finds
sweepers in the ``hydra_plugins`` namespace only, hence this module's place.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper


class PackingSweeper(BasicSweeper):
    def __init__(self, max_batch_size: int | None = None, params: Any = None, pack: int = 1):
        super().__init__(max_batch_size=max_batch_size, params=params)
        self.pack = int(pack)
        self.plan: dict[str, list[list[str]]] = {}

    def get_job_batch(self) -> Any:
        from tta_bench.paths import atomic_write_text
        from tta_bench.run.sweep import PACKS, pack_jobs

        batch, plan = pack_jobs(super().get_job_batch(), self.pack)
        self.plan.update(plan)
        assert self.config is not None
        path = Path(str(self.config.hydra.sweep.dir)) / PACKS
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(self.plan, indent=1) + "\n")
        return batch
