"""What composing a run config costs (``tta_bench.config.compose``: every ``tta-bench run``,
``tta_bench.evaluate`` and sweep job composes one), against the code it replaced:

* **used**: ``config.compose``: Hydra set up without a primary config directory and without
  reading the call stack; a node written into Hydra's config store only when it changed;
  Hydra's own groups the run config never reads (logging, help, output, env) left out of
  its defaults list; the store narrowed, while composing, to the run's own method and model
  nodes (Hydra deep-copies the store at each composition);
* **replaced**: the same composition through ``hydra.initialize(config_path=None)``, which
  reads every frame of the call stack (``inspect.stack()``) to find its caller's file, with
  the run, method and model nodes stored again at every call.

``config.compose`` keeps Hydra's composition of a run's group choices (method, model,
``hydra/...``) per process and applies the run's other overrides to a copy: it is timed as
a process's **first** run of its choices (nothing kept) and as a **later** run with other
overrides (``protocol.max_images`` changes at every call).

Both are timed with one method in Hydra's config store (a ``tta-bench run`` process) and with
every registered method and model in it (a process that ran many, as a test worker or an
in-process sweep). Each measurement alternates the two ``--repeats`` times and prints the
median and range of each and the ratio of the medians. Both are first checked to compose the
same config.

The read of the stack costs most where the stack holds frames of no module's file, as
``python -m`` puts there (the frozen ``runpy``'s; ``python -m pytest``, ``python -m
tta_bench.cli``): run it both ways::

    python -m benchmarks.compose_cost [--repeats 15] [--torch]  # as python -m pytest
    python benchmarks/compose_cost.py [--repeats 15] [--torch]  # as the tta-bench script

``--torch`` imports torch and open_clip first (a test worker, a notebook, an application
calling ``tta_bench.evaluate``): the stack read scans every loaded module.

Run it on an idle machine (``uptime``): the figures are timings. Nothing else is asserted.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import itertools
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from omegaconf import OmegaConf

from tta_bench import catalog, config
from tta_bench.registry import registry


def _replaced(overrides: list[str], method: str, model: str) -> Any:
    """The composition as ``config.compose`` did it before (hydra.initialize, a store of
    the three nodes at every call)."""
    from hydra import compose as hydra_compose
    from hydra import initialize
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    saved = copy.copy(cs.repo), {g: copy.copy(cs.repo.get(g, {})) for g in ("method", "model")}
    cs.store(name="tta_bench_run", node=config.run_config())
    cs.store(group="method", name=method, node=registry("methods").get(method).Config)
    factory = registry("models").get(model)
    cs.store(group="model", name=model, node=config.factory_config(model, factory))
    try:
        with initialize(config_path=None, version_base="1.3"):
            return hydra_compose(
                config_name="tta_bench_run",
                overrides=config.hydra_overrides(overrides, method, model),
            )
    finally:  # the nodes config.compose stored, back (it would compose afresh otherwise)
        cs.repo.clear()
        cs.repo.update(saved[0])
        cs.repo.update(saved[1])


def _fmt(values: list[float]) -> str:
    v = [x * 1e3 for x in values]
    return f"{statistics.median(v):.1f} ms ({min(v):.1f}-{max(v):.1f})"


def _pair(used: Callable[[], Any], replaced: Callable[[], Any], repeats: int) -> str:
    used(), replaced()  # warm-up
    a: list[float] = []
    b: list[float] = []
    for _ in range(repeats):
        for fn, out in ((used, a), (replaced, b)):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    ratio = statistics.median(b) / statistics.median(a)
    return f"{_fmt(a):24s} {_fmt(b):24s} {ratio:.2f}x"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--torch", action="store_true",
        help="import torch and open_clip first, as a test worker or a notebook has them",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")

    if args.torch:
        import open_clip  # noqa: F401
        import torch  # noqa: F401
    method, model = catalog.default("method"), catalog.default("model")
    overrides = ["seeds=[0]", "protocol.max_images=64"]
    images = itertools.count(1)

    def first() -> Any:
        config.clear_compose_memo()
        return config.compose(list(overrides), method, model)

    def later() -> Any:
        return config.compose(["seeds=[0]", f"protocol.max_images={next(images)}"], method, model)

    replaced = lambda: _replaced(list(overrides), method, model)  # noqa: E731
    assert OmegaConf.to_container(first()) == OmegaConf.to_container(replaced())
    assert OmegaConf.to_container(config.compose(list(overrides), method, model)) == (
        OmegaConf.to_container(replaced())
    )

    runpy_frames = sum(f.filename == "<frozen runpy>" for f in inspect.stack(0))
    print(f"python -m: {'yes' if runpy_frames else 'no'} ({runpy_frames} runpy frames); "
          f"{len(sys.modules)} modules loaded; {method} on {model}")  # fmt: skip
    print(f"{'config store':28s} {'used: median (range)':24s} {'replaced':24s} ratio")
    for used, which in ((first, "first"), (later, "later")):
        print(f"{'1 method, ' + which:28s} {_pair(used, replaced, args.repeats)}")
    methods, models = registry("methods").names(), registry("models").names()
    config._register(methods, models)
    for used, which in ((first, "first"), (later, "later")):
        label = f"{len(methods)} methods, {which}"
        print(f"{label:28s} {_pair(used, replaced, args.repeats)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
