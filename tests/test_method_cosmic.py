"""COSMIC (mura_plugin/methods/cosmic.py): the degree-targeted graph, the second-order
graph, the maximal cliques and the clique scores against numpy (and networkx) references;
DMN's read-out and confident views; the rebuild schedule and one image's wiring by hand;
a real step with the run's model and with a registered auxiliary model; the CuPL head;
the runner; refusals."""

from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest
import torch
from method_runs import assert_reset_then_reseed_reproduces, build_method, run_method

from mura_plugin.methods.cosmic import (
    COSMIC,
    build_cliques,
    clique_scores,
    confident_views,
    degree_graph,
    maximal_cliques,
    readout_prototypes,
    second_order,
)
from mura_plugin.methods.dmn import confident_label, memory_readout


def _np_degree_graph(sim, target, tol=1e-2, max_iter=500):
    """The official ``build_graph_by_degree`` in numpy: float32 comparisons and degrees,
    every one of the ``max_iter`` steps."""
    n = sim.shape[0]
    low, high = float(sim.min()), float(sim.max())
    for _ in range(max_iter):
        mid = (low + high) / 2
        adj = (sim > np.float32(mid)).astype(np.float32)
        np.fill_diagonal(adj, 0)
        avg = np.float32(adj.sum()) / np.float32(n)
        if abs(avg - np.float32(target)) < np.float32(tol):
            break
        if avg < target:
            high = mid
        else:
            low = mid
    return adj, mid


@pytest.mark.parametrize("seed, n, target", [(0, 12, 4.0), (1, 20, 5.0), (2, 7, 3.0)])
def test_degree_graph_against_numpy(seed, n, target):
    rng = np.random.default_rng(seed)
    f = rng.normal(size=(n, 6)).astype(np.float32)
    f /= np.linalg.norm(f, axis=1, keepdims=True)
    sim = f @ f.T
    expected, mid = _np_degree_graph(sim, target)
    got, threshold = degree_graph(torch.tensor(sim), target)
    np.testing.assert_array_equal(got.numpy(), expected)
    assert threshold == mid


def test_second_order_graph_and_cliques_by_hand():
    adj = torch.zeros(7, 7)
    edges = [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3), (0, 4), (4, 5), (5, 6), (4, 6)]
    for i, j in edges:
        adj[i, j] = adj[j, i] = 1.0
    # the K4 edges share two neighbours each; 0-4 none; the triangle's edges one each
    sog = second_order(adj)
    assert maximal_cliques(adj) == [[0, 1, 2, 3], [0, 4], [4, 5, 6]]
    assert maximal_cliques(sog) == [[0, 1, 2, 3], [4], [5], [6]]
    feats = torch.eye(6)
    cliques, anchors = build_cliques(feats, target=0.5, sog=False)
    assert cliques == [[0], [1], [2], [3], [4], [5]]  # orthogonal rows: no edge
    torch.testing.assert_close(anchors, feats)


def test_maximal_cliques_match_networkx():
    nx = pytest.importorskip("networkx")
    rng = np.random.default_rng(5)
    for _ in range(5):
        a = np.triu((rng.random((15, 15)) < 0.35).astype(np.float32), 1)
        a = a + a.T
        expected = sorted(sorted(c) for c in nx.find_cliques(nx.from_numpy_array(a)))
        assert maximal_cliques(torch.tensor(a)) == expected


def test_clique_scores_against_numpy():
    rng = np.random.default_rng(6)
    space = rng.normal(size=(5, 4)).astype(np.float32)
    space /= np.linalg.norm(space, axis=1, keepdims=True)
    cliques = [[0, 1], [2], [1, 3, 4]]
    anchors = np.stack([space[c].mean(0) for c in cliques])
    q = space[3] + 0.1 * rng.normal(size=4).astype(np.float32)
    q /= np.linalg.norm(q)
    alpha, beta = 2.0, 5.0
    for r, top in [(0.2, 1), (0.7, 2), (1.0, 3)]:
        chosen = np.argsort(-(anchors @ q), kind="stable")[:top]
        nodes = sorted({v for c in chosen for v in cliques[c]})
        expected = np.zeros(5, dtype=np.float32)
        expected[nodes] = alpha * np.exp(-(beta - beta * (space[nodes] @ q)))
        got = clique_scores(
            torch.tensor(q), torch.tensor(anchors), torch.tensor(space), cliques, r, alpha, beta
        )
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5)
    # ties between anchors: the first clique in order
    tied = torch.tensor(np.stack([anchors[2], anchors[2], anchors[0]]))
    got = clique_scores(torch.tensor(q), tied, torch.tensor(space), cliques, 0.2, 1.0, 1.0)
    assert torch.nonzero(got).flatten().tolist() == [0, 1]


def test_readout_and_confident_views_match_dmn():
    rng = np.random.default_rng(7)
    feats = torch.tensor(rng.normal(size=(4, 3, 6)), dtype=torch.float32)
    filled = torch.tensor([[True, True, False], [False] * 3, [True] * 3, [True, False, False]])
    text = torch.nn.functional.normalize(
        torch.randn(4, 6, generator=torch.Generator().manual_seed(0)), dim=-1
    )
    q = torch.nn.functional.normalize(torch.tensor(rng.normal(size=6), dtype=torch.float32), dim=0)
    protos = readout_prototypes(feats, filled, text, q, 5.5)
    torch.testing.assert_close(protos.norm(dim=-1), torch.ones(4))
    expected = memory_readout(feats, filled, text, q, 5.5, 20.0)
    torch.testing.assert_close((20.0 * protos @ q).softmax(-1), expected)
    logits = torch.tensor(rng.normal(size=(8, 5)) * 3, dtype=torch.float32)
    label, ent, chosen = confident_views(logits, 3)
    assert (label, ent) == pytest.approx(confident_label(logits, 3, "prob"))
    p = logits.softmax(-1).numpy()
    ranking = -(p * np.log(p + 1e-6)).sum(1)
    assert chosen.tolist() == np.argsort(ranking, kind="stable")[:3].tolist()


def test_rebuild_schedule(classifier):
    method = build_method(COSMIC, classifier)  # 10 classes, 16 shots: 160 images early
    cases = [(0, True, True), (5, False, False), (160, True, True), (161, True, False)]
    cases += [(200, False, True), (250, True, False), (300, False, True)]
    for seen, updated, rebuild in cases:
        method.seen = seen
        assert method._rebuild(updated, 16) is rebuild, (seen, updated)


def test_one_image_by_hand(classifier):
    """The wiring of one image: the memory write, the auxiliary cache, the two graphs and
    the fused output, from synthetic view features."""
    method = build_method(COSMIC, classifier, selection=0.5)
    head = method.head
    gen = torch.Generator().manual_seed(1)
    feats = torch.nn.functional.normalize(head[3] + 0.3 * torch.randn(4, 64, generator=gen), dim=-1)
    aux = torch.nn.functional.normalize(torch.randn(64, generator=gen), dim=0)
    out = method._sample(feats, aux)
    scale = float(classifier.logit_scale)
    label, ent, chosen = confident_views(scale * feats @ head.t(), 2)
    assert method.memory.count[label] == 1
    torch.testing.assert_close(method.memory.features[label, 0], feats[chosen].mean(0))
    protos = readout_prototypes(method.memory.features, method.memory.filled(), head, feats[0], 5.5)
    p_zs = (scale * feats[0] @ head.t()).softmax(-1)
    mixed = p_zs + (scale * protos @ feats[0]).softmax(-1)
    cache = method.aux_cache
    assert torch.isfinite(cache.entropy).sum() == 1
    assert torch.equal(cache.keys[int(mixed.argmax()), 0], aux)
    space = torch.cat([head, protos])
    cliques, anchors = build_cliques(space, 4.0)  # 0.8 x the target degree 5
    assert method.clip_graph[0] == cliques
    s1 = clique_scores(feats[0], anchors, space, cliques, 0.2, 2.0, 5.0)
    aux_protos = torch.zeros(10, 64)
    aux_protos[int(mixed.argmax())] = aux
    cliques2, anchors2 = build_cliques(aux_protos, 5.0)
    s2 = clique_scores(aux, anchors2, aux_protos, cliques2, 0.2, 2.0, 5.0)
    torch.testing.assert_close(out, p_zs + (s1[:10] + s1[10:]) / 2 + s2)
    assert method.seen == 1
    silent = build_method(COSMIC, classifier, selection=0.5, clip_weight=0.0, aux_weight=0.0)
    torch.testing.assert_close(silent._sample(feats, aux), p_zs)


def test_step_reset_seeds_and_aux_model(classifier, test_images):
    images = test_images[0][:12]
    fresh, used, expected = assert_reset_then_reseed_reproduces(
        lambda: build_method(COSMIC, classifier, n_views=3), images
    )
    assert expected.shape == (12, 10) and torch.isfinite(expected).all()
    assert fresh.seen == 12 and fresh.clip_graph is not None and fresh.aux_graph is not None
    assert fresh.resolved_settings()["aux_model"] is None
    # a registered auxiliary encoder: the tiny model again gives the same features
    aux = build_method(COSMIC, classifier, n_views=3, aux_model="tiny-clip-digits")
    assert aux.aux is not None and aux.aux is not aux.model
    settings = aux.resolved_settings()
    assert settings["aux_model"] == "tiny-clip-digits" and settings["aux_weights_sha256"]
    aux.reseed(5)
    torch.testing.assert_close(aux.step(images), expected, rtol=0, atol=1e-5)
    assert aux.predict(images).shape == (12, 10)
    with pytest.raises(ValueError, match="nope"):
        build_method(COSMIC, classifier, aux_model="nope")


def test_cupl_prompts_head(classifier, tmp_path):
    names = classifier.classnames
    sentences = {
        n: [f"a blurry photo of the number {n}.", f"the handwritten digit {n}."] for n in names
    }
    path = tmp_path / "cupl.json"
    path.write_text(json.dumps(sentences))
    method = build_method(COSMIC, classifier, prompts=str(path))
    expected = classifier.encode_templates(classifier.templates, sentences)
    torch.testing.assert_close(method.head, expected.float())
    assert not torch.allclose(method.head, classifier.class_embeddings.float())
    del sentences[names[4]]
    path.write_text(json.dumps(sentences))
    with pytest.raises(ValueError, match="method.prompts.*'four'"):
        build_method(COSMIC, classifier, prompts=str(path))
    with pytest.raises(ValueError, match="method.prompts"):
        build_method(COSMIC, classifier, prompts=str(tmp_path / "missing.json"))


def test_runs_through_the_runner(tmp_path):
    record = run_method(tmp_path, "cosmic", "method.n_views=3", max_images=16)
    cell = record["cells"][0]
    assert 0.0 <= cell["accuracy"] <= 1.0
    assert record["scores_are_logits"] is False
    assert cell["backward_passes_per_sample"] == 0.0


def test_bad_config_values(classifier):
    for field, value in [("r", 0.0), ("clip_weight", -1.0), ("text_head", "mine")]:
        with pytest.raises(ValueError, match=f"method.{field}"):
            COSMIC(
                copy.deepcopy(classifier), dataclasses.replace(COSMIC.Config(), **{field: value})
            )
