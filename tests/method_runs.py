"""What the method test files share: ``build_method``, a method on its own copy of the
classifier, set up; and ``run_method``, one short run of a registered method as
``tta-bench run`` makes it (the method by its entry-point name, the overrides resolved and
checked by the CLI's own ``resolve_run``, the TTA-VLM option exactly as ``tta_vlm=true``
applies it, then the real runner)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def build_method(cls: Any, classifier: Any, seed: int = 0, **overrides: Any) -> Any:
    """``cls`` with its default config changed by ``overrides``, on a copy of
    ``classifier`` (the shared one is never touched), set up with torch seeded by ``seed``."""
    import copy
    import dataclasses

    import torch

    torch.manual_seed(seed)
    method = cls(copy.deepcopy(classifier), dataclasses.replace(cls.Config(), **overrides))
    method.setup()
    return method


#: The cell every such run scores: one digits-c domain, seed 0.
CELL = ["protocol.shifts=[contrast]", "seeds=[0]", "progress=false"]


def run_method(
    tmp_path: Path, method: str, *overrides: str, tta_vlm: bool = False, max_images: int = 32
) -> dict[str, Any]:
    """The results record of ``method`` on ``max_images`` images of digits-c's contrast
    cell; ``overrides``: CLI overrides (``method.views=3``, ``protocol.batch_size=1``);
    ``tta_vlm``: under ``tta_vlm=true``."""
    from tta_bench.run import runner
    from tta_bench.run.resolve import resolve_run

    args = [*CELL, f"protocol.max_images={max_images}", *overrides]
    if tta_vlm:
        args.append("tta_vlm=true")
    _, spec = resolve_run(method=method, overrides=args)
    return runner.run(spec, tmp_path / "r.json")
