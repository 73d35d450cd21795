"""``tta-bench profile``: run a short slice of a run and say where the time goes.

The slice is the first ``batches`` batches of the run's real stream, through the real
loader, shift kernels and method. Time is split into *data wait* (waiting for the loader
and the copy to the device), *shift* (corrupting on the device), *model* (the method's
adapt-and-predict step) and *reference* (scoring the frozen source model, when on). The
report ends with a recommendation in plain words.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

#: Data-wait share above which the model is called starved.
STARVED = 0.15
#: Shift share above which the corruption kernels are called the bottleneck.
SHIFT_HEAVY = 0.30


@dataclass(frozen=True)
class Profile:
    """Seconds per phase over ``images`` images in ``batches`` batches."""

    batches: int
    images: int
    setup_s: float
    data_wait_s: float
    shift_s: float
    model_s: float
    reference_s: float
    device: str
    loader: dict[str, Any]

    @property
    def loop_s(self) -> float:
        return self.data_wait_s + self.shift_s + self.model_s + self.reference_s

    @property
    def data_wait_share(self) -> float:
        return self.data_wait_s / max(self.loop_s, 1e-12)

    @property
    def shift_share(self) -> float:
        return self.shift_s / max(self.loop_s, 1e-12)

    def recommendation(self) -> str:
        """What to change, in plain words (or that nothing needs to)."""
        workers = int(self.loader["num_workers"])
        wait = self.data_wait_share
        if wait > STARVED:
            if workers == 0:
                return (
                    f"The model waits for data {100 * wait:.0f}% of the time. Load batches in "
                    f"background processes: raise loader.num_workers (e.g. "
                    f"loader.num_workers=4)."
                )
            return (
                f"The model waits for data {100 * wait:.0f}% of the time even with "
                f"{workers} loader workers. Raise loader.num_workers or "
                f"loader.prefetch_factor, and keep the decoded cache (TTA_BENCH_CACHE) on a "
                f"local disk."
            )
        if self.shift_share > SHIFT_HEAVY:
            where = "on the CPU" if self.device == "cpu" else "on the device"
            return f"The shift kernels take {100 * self.shift_share:.0f}% of the time {where}. " + (
                "Run on a GPU (device=cuda) so they run next to the model."
                if self.device == "cpu"
                else "Profile the slow kernel; data loading is not the problem."
            )
        return (
            f"The model's own step takes {100 * self.model_s / max(self.loop_s, 1e-12):.0f}% "
            "of the time: the pipeline keeps it fed, nothing to change."
        )

    def table(self) -> str:
        """The time split as a text table."""
        from tabulate import tabulate

        rows = [
            ["data wait", self.data_wait_s],
            ["shift", self.shift_s],
            ["model", self.model_s],
            ["reference", self.reference_s],
        ]
        total = max(self.loop_s, 1e-12)
        body = [
            [
                name,
                f"{1e3 * s:.1f}",
                f"{1e3 * s / max(self.images, 1):.3f}",
                f"{100 * s / total:.0f}%",
            ]
            for name, s in rows
        ]
        return tabulate(body, headers=["phase", "total ms", "ms/image", "share"])


def profile(spec: Any, batches: int = 20) -> Profile:
    """Run the first ``batches`` batches of ``spec`` (results to a temporary file)."""
    from tta_bench.run.runner import Evaluation

    if batches < 1:
        raise ValueError(f"batches must be >= 1, got {batches}")
    spec = replace(spec, resume=False, progress=False)
    with tempfile.TemporaryDirectory(prefix="tta-profile-") as tmp:
        start = time.perf_counter()
        ev = Evaluation(spec, Path(tmp) / "profile.json", max_batches=batches)
        record = ev.run()
        total = time.perf_counter() - start
    sec = ev.phase_seconds
    loop = record["loop"]
    return Profile(
        batches=int(loop["batches"]),
        images=int(loop["images"]),
        setup_s=max(0.0, total - loop["wall_s"]),
        data_wait_s=sec.get("data", 0.0),
        shift_s=sec.get("shift", 0.0),
        model_s=sec.get("method", 0.0),
        reference_s=sec.get("reference", 0.0),
        device=ev.device.type,
        loader=loop["loader"],
    )
