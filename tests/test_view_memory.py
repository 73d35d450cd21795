"""The view memory budget (``view_memory_mb``): the views of a batch are drawn at once,
then rendered and encoded in chunks of whole images, so that peak memory follows the
budget and not the batch, while every output stays what the unbounded run gives."""

from __future__ import annotations

import pytest
import torch
from method_runs import build_method, run_method

from mura_plugin import augment
from mura_plugin.methods import _view_budget as _views
from tta_bench.registry import registry

#: A budget below one image's views: one image per chunk, nothing kept (``LazyViews``).
TINY = 1e-4
#: Room for the whole batch: the views are built in one piece, as before the budget.
UNBOUNDED = 1e6
#: A budget of two 32 px images' views with AugMix and 8 views (the chunked, kept path).
TWO = 2 * 9 * 3 * 32 * 32 * 4 * 16 / 2**20

#: Every registered method that builds views, with a config that keeps it small; the
#: AugMix ones AugMix so that each draw is exercised.
MULTI_VIEW = {
    "tpt": {"views": 7, "augmix": True},
    "ctpt": {"views": 7},
    "rtpt": {"views": 7},
    "rlcf": {"views": 7, "steps": 2},
    "lora": {"views": 7, "steps": 2},
    "mura": {"views": 7, "steps": 2},
    "zero": {"views": 7},
    "tda": {"views": "multi", "n_views": 7},
    "dmn": {"n_views": 7},
    "dpe": {"views": "multi", "n_views": 7},
    "mta": {"views": 7},
    "boostadapter": {"n_views": 7},
    "dynaprompt": {"views": 7},
    "tps": {"views": 7},
}


def test_a_plan_renders_the_same_views_whole_or_in_chunks():
    images = torch.rand(5, 3, 24, 24, generator=torch.Generator().manual_seed(0))
    kw = {"augmix_views": True, "rotate_degrees": 12.0}
    whole = augment.make_views(images, 6, torch.Generator().manual_seed(1), **kw)
    plan = augment.plan_views(5, 24, 24, 6, torch.Generator().manual_seed(1), **kw)
    parts = [
        augment.render_views(images[r], plan.rows(r))
        for r in (slice(0, 2), slice(2, 3), slice(3, 5))
    ]
    assert torch.equal(torch.cat(parts, dim=1), whole)
    with pytest.raises(ValueError, match="plan is for 2 images, got 3"):
        augment.render_views(images[:3], plan.rows(slice(0, 2)))


def test_image_chunks_follow_the_budget():
    per_image = 3 * 2**20  # 3 MB an image
    assert _views.image_chunks(10, per_image, 7.0) == [slice(0, 2), slice(2, 4), slice(4, 6),
                                                      slice(6, 8), slice(8, 10)]  # fmt: skip
    assert _views.image_chunks(3, per_image, 1.0) == [slice(0, 1), slice(1, 2), slice(2, 3)]
    assert _views.image_chunks(4, per_image, 100.0) == [slice(0, 4)]


def test_every_view_method_has_the_budget_option():
    """Each method above exposes ``view_memory_mb``, left out of the run key at its default
    (committed cells keep their key); the list covers every method that builds views."""
    from tta_bench.run.resume import method_config_hash

    methods = registry("methods")
    for name in MULTI_VIEW:
        cfg = methods.get(name).Config()
        assert cfg.view_memory_mb == _views.VIEW_MEMORY_MB
        assert "view_memory_mb" in type(cfg).hash_omit_at_default
        import dataclasses

        other = dataclasses.replace(cfg, view_memory_mb=1.0)
        assert method_config_hash(other) != method_config_hash(cfg)


#: The loop's other paths: batch episodes (the mean accumulated chunk by chunk), the
#: sequential per-sample loop, and predictions without adaptation (R-TPT's view ensemble).
OTHER_PATHS = {
    "mura-batch": ("mura", {"views": 7, "episodic": "batch", "router_persist": False}),
    "tpt-batch-2-steps": ("tpt", {"views": 7, "episodic": "batch", "steps": 2}),
    "lora-online": ("lora", {"views": 7, "episodic": "online"}),
    "tpt-sequential": ("tpt", {"views": 7, "episode_batching": False}),
    "rtpt-predict-only": ("rtpt", {"views": 7, "adapt_every": 2}),
}


@pytest.mark.parametrize(
    ("name", "overrides"),
    [*sorted(MULTI_VIEW.items()), *OTHER_PATHS.values()],
    ids=[*sorted(MULTI_VIEW), *OTHER_PATHS],
)
def test_a_tiny_budget_changes_no_output(name, overrides, classifier, noisy_images, monkeypatch):
    """The same logits (to float32 rounding: a chunk's forward has fewer rows) and the same
    predictions with the views built one image at a time, two at a time and all at once;
    the tiny budget does build them in pieces."""
    cls = registry("methods").get(name)
    calls = []
    real = augment.render_views

    def counting(images, plan):
        calls.append(images.shape[0])
        return real(images, plan)

    monkeypatch.setattr(_views, "render_views", counting)
    outs = {}
    for budget in (UNBOUNDED, TWO, TINY):
        calls.clear()
        method = build_method(cls, classifier, **overrides, view_memory_mb=budget)
        method.reseed(3)
        outs[budget] = torch.cat([method.step(noisy_images), method.step(noisy_images[:4])])
        if budget == TINY:
            assert calls and max(calls) == 1, calls  # one image per chunk
        if budget == UNBOUNDED:
            assert calls[:1] == [6], calls  # the whole batch at once
    for budget in (TWO, TINY):
        torch.testing.assert_close(outs[budget], outs[UNBOUNDED], rtol=0, atol=2e-5)
        assert torch.equal(outs[budget].argmax(-1), outs[UNBOUNDED].argmax(-1))


@pytest.mark.parametrize(
    ("method", "overrides"),
    [("mura", []), ("tpt", ["method.augmix=true"]), ("tda", ["method.views=multi"])],
)
def test_cells_with_a_tiny_budget_equal_the_unbounded_run(tmp_path, method, overrides):
    """Through the runner: the cell (accuracy, per-sample predictions) is identical."""
    common = [*overrides, "method.views=7" if method != "tda" else "method.n_views=7"]
    records = []
    for i, budget in enumerate((UNBOUNDED, TINY)):
        out = tmp_path / str(i)
        out.mkdir()
        records.append(
            run_method(out, method, *common, f"method.view_memory_mb={budget}", max_images=16)
        )
    cells = [r["cells"] for r in records]
    assert cells[0] and all(c["accuracy"] is not None for c in cells[0])
    assert [c["accuracy"] for c in cells[0]] == [c["accuracy"] for c in cells[1]]
    for key in ("ece", "nll"):
        assert [c[key] for c in cells[0]] == pytest.approx([c[key] for c in cells[1]], abs=1e-6)


#: Batched per-sample episodes: MuRA (its router persists: one step per batch), TTL's LoRA
#: (nothing persists), TPT (a prompt per sample, its confident views kept across steps).
EPISODES = {
    "mura": {"views": 7},  # its copies wait on disk (the default)
    "mura-memory": {"views": 7, "copies_wait": "memory"},
    "mura-recompute": {"views": 7, "copies_wait": "recompute"},
    "mura-no-router": {"views": 7, "router_persist": False, "steps": 2},
    "lora": {"views": 7, "steps": 2},
    "tpt": {"views": 7, "steps": 2},
}


@pytest.mark.parametrize("key", sorted(EPISODES))
def test_episodes_run_group_by_group_with_the_same_output(
    key, classifier, noisy_images, monkeypatch
):
    """With a tiny budget the per-sample episodes run one group (here one image) at a
    time, so no more adapter copies (with their gradients and optimiser state) are alive
    at once than a group holds; the logits are those of the whole batch as one group
    (forced), to float32 rounding, and the predictions and the loss the same."""
    cls = registry("methods").get(key.split("-")[0])
    overrides = EPISODES[key]
    sizes: list[int] = []
    real_begin, real_adapt = cls.begin_episodes, cls.adapt_episodes
    adapted: list[int] = []

    def counting(self, n):
        sizes.append(n)
        return real_begin(self, n)

    def counting_adapt(self, inputs, n, **kwargs):
        adapted.append(n)
        return real_adapt(self, inputs, n, **kwargs)

    monkeypatch.setattr(cls, "begin_episodes", counting)
    monkeypatch.setattr(cls, "adapt_episodes", counting_adapt)
    outs, losses = {}, {}
    for mode in ("groups", "whole"):
        if mode == "whole":
            monkeypatch.setattr(cls, "episode_groups", lambda self, n: [slice(0, n)])
        sizes.clear()
        adapted.clear()
        method = build_method(cls, classifier, **overrides, view_memory_mb=TINY)
        method.reseed(3)
        outs[mode] = torch.cat([method.step(noisy_images), method.step(noisy_images[:4])])
        losses[mode] = method.last_loss
        if mode == "groups":
            assert sizes and max(sizes) == 1, sizes
            # MuRA's router waits for every group: with copies_wait=recompute its groups'
            # episodes run again after the step (twice each), else their copies wait
            replays = 2 if key == "mura-recompute" else 1
            assert adapted == [1] * (replays * (noisy_images.shape[0] + 4)), adapted
        else:
            assert sizes == [6, 4], sizes
    torch.testing.assert_close(outs["groups"], outs["whole"], rtol=0, atol=2e-5)
    assert torch.equal(outs["groups"].argmax(-1), outs["whole"].argmax(-1))
    torch.testing.assert_close(losses["groups"], losses["whole"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("wait", _views.COPIES_WAIT)
def test_a_persistent_router_steps_once_per_batch_over_all_groups(wait, classifier, noisy_images):
    """MuRA's router (kept across episodes) takes the batch's one step from every group's
    gradient: its value after a batch run in groups equals the whole-batch run's, whether
    the groups' adapted copies wait for the step on disk or in memory, or are computed
    again after it."""
    cls = registry("methods").get("mura")
    routers = []
    for budget in (TINY, UNBOUNDED):
        method = build_method(cls, classifier, views=7, view_memory_mb=budget, copies_wait=wait)
        episode = {id(p) for p in method.episode_parameters()}
        shared = [p for p in method.params if id(p) not in episode]
        assert shared  # the router
        before = torch.cat([p.detach().flatten() for p in shared])
        method.reseed(3)
        method.step(noisy_images)
        routers.append(torch.cat([p.detach().flatten() for p in shared]))
        assert not torch.equal(routers[-1], before)  # it took its step
    torch.testing.assert_close(routers[0], routers[1], rtol=0, atol=1e-7)


def test_mura_copies_wait_on_disk_in_memory_or_nowhere_with_the_same_logits(
    classifier, noisy_images, monkeypatch
):
    """Where MuRA's adapted copies wait for the router's step (``copies_wait``) changes no
    logit, bit for bit: on disk they are in an unlinked temporary file (no block of the
    batch in memory), in memory in one block per copy, and with ``recompute`` nowhere."""
    cls = registry("methods").get("mura")
    held: list[tuple[str, int, bool]] = []
    real_close = _views.WaitingCopies.close

    def spying_close(self):
        in_memory = self._blocks is not None
        on_disk = self._file is not None
        held.append((self.where, self.nbytes, in_memory, on_disk))
        real_close(self)

    monkeypatch.setattr(_views.WaitingCopies, "close", spying_close)
    outs = {}
    for wait in _views.COPIES_WAIT:
        held.clear()
        method = build_method(cls, classifier, views=7, view_memory_mb=TINY, copies_wait=wait)
        method.reseed(3)
        outs[wait] = method.step(noisy_images)
        n = noisy_images.shape[0]
        per_sample = sum(
            p[0].numel() * p.element_size() for p in method.begin_episodes(1) if p.dim() > 0
        )
        method.end_episodes()
        if wait == "recompute":
            assert held == []
        else:
            assert held == [(wait, n * per_sample, wait == "memory", wait == "disk")], held
    assert torch.equal(outs["disk"], outs["memory"])
    assert torch.equal(outs["disk"], outs["recompute"])


def test_an_unknown_copies_wait_is_refused_naming_the_options(classifier):
    with pytest.raises(
        ValueError, match="unknown method.copies_wait='ram'; available: disk, memory, recompute"
    ):
        build_method(registry("methods").get("mura"), classifier, copies_wait="ram")
