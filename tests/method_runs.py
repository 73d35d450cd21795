"""What the method test files share: ``build_method``, a method on its own copy of the
classifier, set up; ``run_method``, one short run of a registered method as
``tta-bench run`` makes it (the method by its entry-point name, the overrides resolved and
checked by the CLI's own ``resolve_run``, the TTA-VLM option exactly as ``tta_vlm=true``
applies it, then the real runner), and ``scored_cell``, the checked first cell of its
record; ``build_with_source``, a method handed the source images it asks for before its
setup; ``digits_c_spec``, the ``RunSpec`` of a short digits-c run; ``FAST``, the few views
the method tests use; and the checks several methods share: ``seeded_step``,
``assert_same_seeded_steps``, ``assert_batched_episodes_equal_sequential``,
``assert_reset_then_reseed_reproduces`` and ``assert_params_at_snapshot``; ``CHEAP``,
``cheap_overrides`` and ``cheap_config``, the contract and adapter tests' cheap settings."""

from __future__ import annotations

from collections.abc import Callable
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


def build_with_source(cls: Any, classifier: Any, config: Any, source: Callable[[int], Any]) -> Any:
    """``cls`` with ``config`` on a copy of ``classifier``; where it asks for ``n`` clean,
    unlabeled source images (``source_images_needed``, EATA's Fisher), handed
    ``source(n)``; then set up with torch seeded 0 (after construction, unlike
    ``build_method``)."""
    import copy

    import torch

    method = cls(copy.deepcopy(classifier), config)
    n = method.source_images_needed()
    if n and method.needs_source_labels:  # source(n, labels=True) -> (images, labels)
        method.set_source(*source(n, labels=True))
    elif n:
        method.set_source(source(n))
    torch.manual_seed(0)
    method.setup()
    return method


def digits_c_spec(method: str, seeds: list[int], protocol: dict[str, Any], **fields: Any) -> Any:
    """The ``RunSpec`` of ``method`` (its default config) with the default model on
    digits-c as ``load_protocol("digits-c", **protocol)`` sets it, over ``seeds``, without
    progress bar or reference; ``fields``: other ``RunSpec`` fields (``loader``, ``resume``)."""
    from tta_bench.registry import registry
    from tta_bench.run.protocol import load_protocol
    from tta_bench.run.spec import RunSpec

    return RunSpec(
        method=method,
        method_config=registry("methods").get(method).Config(),
        model="tiny-clip-digits",
        model_args={},
        protocol=load_protocol("digits-c", **protocol),
        seeds=seeds,
        progress=False,
        reference=False,
        **fields,
    )


#: What the contract and adapter tests change in a method's defaults: the properties they
#: check hold for any view count, source-set size, iteration or prompt count, and the
#: official ones (63 views, 2,000 source images for EATA's Fisher and RMT's warm-up and
#: replay in batches of 64, GTTA's 10,000, WATT-P's 50 meta-iterations and WATT's 2
#: iterations per template, CLIPArTT's, CLIPTTA's and UnInfo's 10 steps a batch,
#: DynaPrompt's 12 prompts) make one setup or step seconds long on a CPU. RMT keeps two
#: warm-up steps (32 source images in batches of 16). ``None`` in the default (WATT's
#: per-mode official count) is replaced too.
CHEAP = {"views": 3, "n_views": 3, "augmentations": 3, "source_size": 32,
         "source_batch_size": 16, "fisher_size": 128, "meta_iterations": 2, "iterations": 1,
         "steps": 2, "buffer_size": 3}  # fmt: skip


def cheap_overrides(method_cls: Any) -> dict[str, int]:
    """The fields of ``method_cls``'s default config that ``CHEAP`` lowers: those of its
    integer fields above the cheap value, or unset (None)."""
    import dataclasses

    cfg = method_cls.Config()
    if not dataclasses.is_dataclass(cfg):
        return {}
    names = {f.name for f in dataclasses.fields(cfg)}
    return {
        k: v for k, v in CHEAP.items()
        if k in names and (getattr(cfg, k) is None
                           or (isinstance(getattr(cfg, k), int) and getattr(cfg, k) > v))
    }  # fmt: skip


def cheap_config(method_cls: Any) -> Any:
    """``method_cls``'s default config with ``cheap_overrides`` applied (a config that is
    not a dataclass as it is)."""
    import dataclasses

    cfg = method_cls.Config()
    if not dataclasses.is_dataclass(cfg):
        return cfg
    return dataclasses.replace(cfg, **cheap_overrides(method_cls))


#: Fewer views than the official 63 keep the method tests fast; each method's test of its
#: defaults checks those separately.
FAST = {"views": 7}

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


def scored_cell(record: dict[str, Any]) -> dict[str, Any]:
    """The first cell of a results record, asserted there, with an accuracy in [0, 1] and
    a finite NLL."""
    import math

    assert record["cells"], "no cell produced"
    cell = record["cells"][0]
    assert 0.0 <= cell["accuracy"] <= 1.0
    assert math.isfinite(cell["nll"])
    return cell


def seeded_step(method: Any, images: Any, seed: int) -> Any:
    """The logits of ``method.step(images)`` right after ``method.reseed(seed)``."""
    method.reseed(seed)
    return method.step(images)


def assert_same_seeded_steps(
    first: Any,
    second: Any,
    images: Any,
    *,
    seed: int,
    atol: float = 1e-5,
    loss_atol: float | None = None,
) -> Any:
    """Step ``first`` then ``second`` on ``images``, each right after ``reseed(seed)``;
    assert their logits agree within ``atol`` (rtol 0) and, where ``loss_atol`` is given,
    their ``last_loss`` within it. Returns ``first``'s logits."""
    import torch

    out = seeded_step(first, images, seed)
    torch.testing.assert_close(out, seeded_step(second, images, seed), rtol=0, atol=atol)
    if loss_atol is not None:
        torch.testing.assert_close(first.last_loss, second.last_loss, rtol=0, atol=loss_atol)
    return out


def assert_batched_episodes_equal_sequential(
    build: Callable[..., Any], images: Any, *, seed: int = 4, loss_atol: float | None = None
) -> tuple[Any, Any, Any]:
    """``build(**overrides)`` makes a new, set-up method. Builds one with batched (parallel
    per-sample) episodes and one with ``episode_batching=False`` (the per-sample
    adapt/predict/restore loop), asserts that only the first batches its episodes, then
    that both step ``images`` alike (``assert_same_seeded_steps`` with ``seed`` and
    ``loss_atol``). Returns (the batched method, the sequential one, the batched logits)."""
    parallel = build()
    sequential = build(episode_batching=False)
    assert parallel.batched_episodes() and not sequential.batched_episodes()
    out = assert_same_seeded_steps(parallel, sequential, images, seed=seed, loss_atol=loss_atol)
    return parallel, sequential, out


def assert_reset_then_reseed_reproduces(
    build: Callable[[], Any], images: Any, *, seed: int = 5
) -> tuple[Any, Any, Any]:
    """``build()`` makes a new, set-up method. Builds a fresh one and a used one (stepped on
    ``images`` after ``reseed(1)``, then ``reset()``), and asserts that after
    ``reseed(seed)`` both step ``images`` to bit-identical logits. Returns (the fresh
    method, the used one, those logits) for each method's own further checks."""
    import torch

    fresh = build()
    used = build()
    seeded_step(used, images, 1)
    used.reset()
    expected = seeded_step(fresh, images, seed)
    assert torch.equal(expected, seeded_step(used, images, seed))
    return fresh, used, expected


def assert_params_at_snapshot(method: Any) -> None:
    """Each of ``method.params`` is bit-identical to its saved state
    (``method._snapshot["params"]``): episodes left the shared state untouched."""
    import torch

    for p, saved in zip(method.params, method._snapshot["params"]):
        assert torch.equal(p, saved)
