"""ECALP (mura_plugin/methods/ecalp.py): the label propagation against a dense numpy
reference, the growing graph against a numpy rebuild of it, the official candidate-store
rule, a real run through the runner, reset and seeds."""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from method_runs import run_method

from mura_plugin.methods.ecalp import ECALP, ECALPConfig, LabelGraph, propagate


def _dense_propagation(img_idx, img_sim, txt_idx, txt_sim, y0, gamma, alpha, iterations):
    """Written from the paper's formulas: dense W over [text; image] nodes, W + W^T,
    D^-1/2 (with 1e-6), Y_img <- alpha W~[img] [I; Y] + (1 - alpha) Y0."""
    n, c = y0.shape
    w = np.zeros((c + n, c + n))
    for u in range(n):
        for v, s in zip(img_idx[u], img_sim[u]):
            w[c + u, c + v] += s**gamma
        for t, s in zip(txt_idx[u], txt_sim[u]):
            w[c + u, t] += s**gamma
    w = w + w.T
    d = 1.0 / (np.sqrt(w.sum(axis=1)) + 1e-6)
    wt = d[:, None] * w * d[None, :]
    y = y0.copy()
    for _ in range(iterations):
        y = alpha * wt[c:] @ np.vstack([np.eye(c), y]) + (1 - alpha) * y0
    return y


@pytest.mark.parametrize(("gamma", "alpha"), [(10.0, 1.0), (2.0, 0.6)])
def test_propagation_on_a_hand_made_graph(gamma, alpha):
    # 4 image nodes, 3 classes: self-loops, a mutual pair (0 <-> 1), a negative similarity
    img_idx = [[0, 1], [1, 0], [2, 1], [3, 0]]
    img_sim = [[0.95, 0.8], [0.9, 0.8], [0.85, 0.6], [0.9, -0.7]]
    txt_idx = [[0, 2], [0, 1], [1, 2], [2, 0]]
    txt_sim = [[0.9, 0.5], [0.7, 0.6], [0.8, 0.4], [0.75, 0.3]]
    y0 = np.array([[0.0, 0.0, 0.0], [0.1, 0.0, 0.0], [0.0, 0.05, 0.0], [0.0, 0.0, 0.0]])
    expected = _dense_propagation(img_idx, img_sim, txt_idx, txt_sim, y0, gamma, alpha, 3)
    got = propagate(
        torch.tensor(img_idx),
        torch.tensor(img_sim),
        torch.tensor(txt_idx),
        torch.tensor(txt_sim),
        torch.tensor(y0, dtype=torch.float32),
        gamma,
        alpha,
        3,
    )
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-9)
    assert float(np.abs(expected).max()) > 1e-3  # the test can fail: values are not tiny


def test_the_growing_graph_equals_a_rebuilt_complete_graph():
    """While N <= k_image every image node links to every image node (the copy included),
    so each step is a complete graph: rebuilt here from scratch with s(u, v) =
    <normalize(f_u * w), f_v> (u the older), the top-3 text edges, Y0 = previous
    pseudo-labels / 5 and the prediction read off the copy."""
    gen = torch.Generator().manual_seed(0)
    c, d, steps = 3, 8, 6
    text = F.normalize(torch.randn(c, d, generator=gen), dim=-1)
    feats = F.normalize(torch.randn(steps, d, generator=gen) + 2 * text[[0, 1, 2, 0, 1, 2]], dim=-1)
    cfg = ECALPConfig()
    graph = LabelGraph(text, cfg)
    t, f = text.double().numpy(), feats.double().numpy()
    w = t.var(axis=0, ddof=1)
    w = w / np.linalg.norm(w)
    wf = f * w
    wf /= np.linalg.norm(wf, axis=1, keepdims=True)
    labels = np.zeros((0, c))
    for i in range(steps):
        nodes = [*range(i + 1), i]  # features of the image nodes: the copy is image i
        n = len(nodes)
        img_idx = [list(range(n)) for _ in range(n)]
        img_sim = [[wf[min(a, b)] @ f[max(a, b)] for b in nodes] for a in nodes]
        cos = f[nodes] @ t.T
        txt_idx = np.argsort(-cos, axis=1)[:, :3]
        txt_sim = np.take_along_axis(cos, txt_idx, axis=1)
        y0 = np.zeros((n, c))
        y0[: len(labels)] = labels
        y = _dense_propagation(img_idx, img_sim, txt_idx, txt_sim, y0, 10.0, 1.0, 3)
        got = graph.add(feats[i])
        np.testing.assert_allclose(got.double().numpy(), y[-1], rtol=1e-4, atol=1e-12)
        labels = np.zeros((n - 1, c))
        top = y[:-1].argmax(axis=1)
        labels[np.arange(n - 1), top] = y[:-1].max(axis=1) / 5
    assert graph.n == steps


def _angle(deg: float) -> torch.Tensor:
    r = math.radians(deg)
    return torch.tensor([math.cos(r), math.sin(r)])


def test_a_neighbour_dropped_without_margin_never_returns():
    """The official store (``dynamic_graph_expansion``) keeps no margin while the older
    nodes number at most k: with k_image 3 and features at 0, 40, 10, 100 and 150 degrees
    (uniform re-weighting: the text embeddings' variances are equal, so s = cosine), node 0
    lists {0, 1, 2} after sample 1, drops node 1 when sample 2 (10 degrees) and its copy
    arrive, and never gets it back although cos(40) exceeds cos(100) and cos(150)."""
    text = torch.eye(2)
    graph = LabelGraph(text, dataclasses.replace(ECALPConfig(), k_image=3))
    graph.add(_angle(0))
    graph.add(_angle(40))
    assert sorted(graph.store_idx[0].tolist()) == [0, 1, 2]
    graph.add(_angle(10))
    assert sorted(graph.store_idx[0].tolist()) == [0, 2, 3]  # node 1 out: no margin
    for deg in (100, 150):
        graph.add(_angle(deg))
        kept = graph.store_idx[0].tolist()
        assert 1 not in kept and 0 in kept and 2 in kept
    # the previous copy's entry is marked -1 and never enters the graph's lists
    assert float(graph.store_sim[0].max()) == pytest.approx(1.0)


@pytest.mark.parametrize("tta_vlm", [False, True])
def test_runs_through_the_runner(tta_vlm, tmp_path):
    record = run_method(tmp_path, "ecalp", tta_vlm=tta_vlm)
    cell = record["cells"][0]
    assert 0.0 <= cell["accuracy"] <= 1.0
    assert cell["forward_passes_per_sample"] <= 1.0
    assert cell["backward_passes_per_sample"] == 0.0
    # its outputs are scores: the record says so and the summary prints no NLL/ECE for it
    from tta_bench.report import tables
    from tta_bench.report.columns import NOT_PROBABILITIES

    assert ECALP.scores_are_logits is False and record["scores_are_logits"] is False
    headers, [row] = tables.summary_rows([record], baseline=None)
    summary = dict(zip(headers, row))
    assert summary["NLL"] == summary["ECE %"] == NOT_PROBABILITIES
    assert summary["accuracy % (95% CI)"] != NOT_PROBABILITIES


def test_logits_are_the_official_scores_and_finite(classifier, test_images):
    x = test_images[0][:12]
    method = ECALP(copy.deepcopy(classifier))
    method.setup()
    logits = method.step(x)
    assert logits.shape == (12, classifier.num_classes) and torch.isfinite(logits).all()
    # the same stream one sample at a time: the graph grows sample by sample either way
    one = ECALP(copy.deepcopy(classifier))
    one.setup()
    singles = torch.cat([one.step(x[i : i + 1]) for i in range(12)])
    torch.testing.assert_close(singles, logits, rtol=1e-4, atol=1e-3)
    assert method.graph.n == 12


def test_reset_returns_to_setup_and_seeds_repeat(classifier, test_images):
    x = test_images[0]
    a, b = x[:8], x[8:16]
    fresh = ECALP(copy.deepcopy(classifier))
    fresh.setup()
    fresh.reseed(5)
    expected = fresh.step(a)
    used = ECALP(copy.deepcopy(classifier))
    used.setup()
    used.reseed(1)
    used.step(b)
    assert used.graph.n == 8
    used.reset()
    assert used.graph.n == 0
    used.reseed(5)
    torch.testing.assert_close(used.step(a), expected, rtol=0, atol=0)
    # online: the second batch depends on the first
    cont = fresh.step(b)
    alone = ECALP(copy.deepcopy(classifier))
    alone.setup()
    assert not torch.equal(cont, alone.step(b))
