"""The compute-matched track (``protocol.realtime=true``), after Alfarra et al., "Evaluation
of Test-Time Adaptation Under Computational Time Constraints", ICML 2024.

When the stream does not wait for the method, a slow method sees fewer of the batches it
would adapt on. The stream reveals one batch per *unit*, the cost of the reference (the
frozen model) on one batch: one forward pass of each image through the image tower. A
method's step on a batch of ``n`` images that made ``f`` forward and ``b`` backward passes
through the tower costs ``k = ceil((f + BACKWARD_UNITS * b) / n)`` units (at least 1). While
it is busy, the next ``k - 1`` batches arrive and are predicted by ``Method.predict``, the
method's current state, without adapting; the batch after them is adapted on again.

The units are counted, not timed (the passes the cost table counts, ``PassCounter``), so the
track is the same on any machine and any load. A backward pass counts as two forward passes
(``BACKWARD_UNITS``), the usual ratio of their arithmetic. Cost the counter cannot see is not
charged: work outside the image tower (a text encoder run again for prompt tuning, an
optimiser over prototypes), so prompt-tuning and prototype methods are charged their image
passes only; the docs say so beside the column.

Differences from Alfarra et al.'s evaluation: they measure the relative speed of a method
in wall time on their GPU; here it is counted. As in their protocol, a batch that arrives
while the method is busy is predicted without an update; the state that predicts it is the
one after the last finished update (this loop is sequential).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from tta_bench.run.stream import Batch, Stream

#: Forward-pass units a backward pass through the image tower costs.
BACKWARD_UNITS = 2


def step_units(forward: int, backward: int, n: int) -> int:
    """Units of one step on ``n`` images with ``forward`` and ``backward`` tower passes."""
    if n <= 0:
        return 1
    return max(1, math.ceil((forward + BACKWARD_UNITS * backward) / n))


class Pace:
    """Which batches a method adapts on under the realtime track (``on``), and how many
    samples of each domain it adapted on; off: every batch is adapted on."""

    def __init__(self, on: bool):
        self.on = bool(on)
        self.busy = 0  # batches still to be predicted while the last step runs
        self.adapted: dict[tuple[str, int], int] = defaultdict(int)
        self.samples: dict[tuple[str, int], int] = defaultdict(int)

    def adapts_now(self) -> bool:
        """Whether the next batch is adapted on (else predicted with the current state)."""
        return not self.on or self.busy == 0

    def done(self, batch: Batch, stream: Stream, adapted: bool, forward: int, backward: int):
        """Account one finished batch: ``adapted`` or predicted, with the tower passes of
        the step (read only when adapted)."""
        if not self.on:
            return
        for d in batch.domains.tolist():
            dom = stream.domains[d]
            self.samples[dom] += 1
            self.adapted[dom] += int(adapted)
        if adapted:
            self.busy = step_units(forward, backward, len(batch)) - 1
        else:
            self.busy -= 1

    def annotate(self, cells: list[dict[str, Any]]) -> None:
        """Write each cell's ``realtime`` entry: samples adapted on and samples seen."""
        if not self.on:
            return
        for cell in cells:
            dom = (str(cell["shift"]), int(cell["severity"]))
            cell["realtime"] = {
                "adapted_samples": int(self.adapted.get(dom, 0)),
                "samples": int(self.samples.get(dom, 0)),
            }
