"""The Python API: ``tta_bench.evaluate`` (the record of ``tta-bench run``) and the
standalone ``Adapter`` around a model, on the real default model and digits images."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from method_runs import cheap_config, cheap_overrides

import tta_bench
from tta_bench.cli import main
from tta_bench.deploy.adapter import Adapter, _named_tensors, method_config
from tta_bench.registry import RegistryError, registry
from tta_bench.rng import stable_seed

METHODS = registry("methods").names()
SMALL = ["protocol.shifts=[gaussian_noise,contrast]", "protocol.max_images=32"]
#: Cell fields that are computed, not measured (times and memory differ run to run).
CELL_KEYS = (
    "shift",
    "severity",
    "seed",
    "n",
    "accuracy",
    "error",
    "ece",
    "nll",
    "reference_accuracy",
    "batches",
    "forward_passes_per_sample",
    "backward_passes_per_sample",
)


# -- evaluate ------------------------------------------------------------------------------
def test_evaluate_returns_the_record_the_cli_writes(tmp_path):
    cli_out = tmp_path / "cli.json"
    args = ["run", "--method", "tent", *SMALL, "method.steps=2", "seeds=[0,1]", "--quiet"]
    assert main([*args, "--output", str(cli_out)]) == 0
    cli = json.loads(cli_out.read_text())
    api_out = tmp_path / "api.json"
    record = tta_bench.evaluate(
        method="tent", overrides=[*SMALL, "method.steps=2"], seeds=[0, 1], output=api_out
    )
    assert json.loads(api_out.read_text())["cells"] == record["cells"]
    for key in ("method", "method_config", "method_config_hash", "suite", "protocol", "seeds"):
        assert record[key] == cli[key], key
    assert record["model"]["state_sha256"] == cli["model"]["state_sha256"]
    assert len(record["cells"]) == len(cli["cells"]) == 4
    by_key = {(c["shift"], c["severity"], c["seed"]): c for c in cli["cells"]}
    for cell in record["cells"]:
        other = by_key[(cell["shift"], cell["severity"], cell["seed"])]
        for key in CELL_KEYS:
            assert cell.get(key) == other.get(key), (key, cell["shift"], cell["seed"])


def test_evaluate_without_output_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    record = tta_bench.evaluate(overrides=SMALL)
    assert record["method"] == "zeroshot"
    assert len(record["cells"]) == 2 * 3  # 2 shifts x the default seeds 0, 1, 2
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"method": "mrua"}, RegistryError, "Did you mean 'mura'"),
        ({"suite": "digits-cx"}, RegistryError, "Did you mean 'digits-c'"),
        ({"overrides": ["method.bogus=1"]}, ValueError, "bogus"),
        ({"overrides": ["method=tent"]}, ValueError, "pass method as the method= argument"),
        ({"seeds": []}, ValueError, "at least one seed"),
    ],
)
def test_evaluate_rejects_bad_input(kwargs, error, message):
    with pytest.raises(error, match=message):
        tta_bench.evaluate(**{"overrides": SMALL, **kwargs})


def test_importing_tta_bench_stays_torch_free():
    import subprocess
    import sys

    code = (
        "import sys, tta_bench\n"
        "assert callable(tta_bench.__getattr__)\n"
        "assert not [m for m in sys.modules if m.startswith('torch')]\n"
        "tta_bench.evaluate, tta_bench.Adapter\n"
        "assert 'torch' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- the adapter ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shifted(test_images):
    """Two low-contrast batches (adaptation has something to do)."""
    x, _ = test_images
    mean = x.mean(dim=(1, 2, 3), keepdim=True)
    x = (x - mean) * 0.3 + mean
    return x[:6], x[6:12]


@pytest.fixture(scope="module")
def source_images():
    """Clean digits train images and their labels: the source split methods like EATA
    (images) and RMT or GTTA (images and labels) ask for."""
    from mura_plugin.datasets.digits import digits_arrays

    x, y = digits_arrays("train")
    return torch.from_numpy(x[:128]).permute(0, 3, 1, 2).float() / 255, torch.from_numpy(y[:128])


def _source_for(name: str, source_images):
    """What the Adapter takes as ``source_images`` for ``name``: the images, or the
    ``(images, labels)`` pair for a method that ``needs_source_labels``."""
    images, labels = source_images
    return (images, labels) if registry("methods").get(name).needs_source_labels else images


def _adapter(name, bundle, source_images, **kw) -> Adapter:
    """The adapter of ``name`` with its cheap config (``method_runs.cheap_overrides``)."""
    source = _source_for(name, source_images)
    cheap = cheap_overrides(registry("methods").get(name))
    return Adapter.from_bundle(
        bundle, dataset="digits", method=name, device="cpu", source_images=source,
        overrides=cheap, **kw,
    )  # fmt: skip


def _runner_method(name: str, classifier, source_images, seed: int = 0):
    """The method as the runner builds it (with the adapter's cheap config): a copy of the
    classifier, seeded setup."""
    cls = registry("methods").get(name)
    config = cheap_config(cls)
    method = cls(copy.deepcopy(classifier), config)
    n = method.source_images_needed()
    if n:
        images, labels = source_images
        method.set_source(images[:n], labels[:n] if cls.needs_source_labels else None)
    torch.manual_seed(stable_seed(name, "setup", seed) % 2**63)
    method.setup()
    return method


#: Methods whose first update waits for 64 samples (their memories' update period).
UPDATE_AFTER_64 = ("rotta", "sotta")


@pytest.mark.parametrize("name", METHODS)
def test_adapter_adapts_as_the_method_does_and_resets_and_spawns_fresh(
    name, default_bundle, classifier, shifted, source_images
):
    """Each step equals the runner's method's step; after three calls a spawned sibling
    and a reset adapter give a fresh adapter's first logits; the user's model and the
    shared backbone are never changed, nor written in place."""
    x, other = shifted
    user_state = {k: v.clone() for k, v in default_bundle.clip.state_dict().items()}
    adapter = _adapter(name, default_bundle, source_images)
    shared = adapter.backbone.model
    shared_state = {k: v.clone() for k, v in shared.state_dict().items()}
    # Written at all, even with its own values, a shared tensor breaks a concurrent
    # adapter's backward in another thread (autograd checks the version counter).
    adapted = set(adapter.backbone.adapted)
    versions = {k: t._version for k, t in _named_tensors(shared) if k not in adapted}
    fresh = Adapter.from_backbone(adapter.backbone)(x).logits  # another adapter's first call

    method = _runner_method(name, classifier, source_images)
    for seed, batch in ((3, other), (4, x)):  # two calls: the adaptation state carries over
        method.reseed(seed)
        expected = method.step(batch).float()
        got = adapter.step(batch, seed=seed)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    pred = adapter(x)
    assert pred.logits.shape == (6, 10) and len(pred.labels) == 6
    assert pred.labels == [adapter.classnames[int(i)] for i in pred.indices]
    # RoTTA and SoTTA update once their memory has seen 64 samples: none after 6
    assert (pred.loss is not None) == (
        registry("methods").get(name).adapts and name not in UPDATE_AFTER_64
    )

    sibling = adapter.spawn()  # spawned from an adapted adapter: still starts from setup
    torch.testing.assert_close(sibling(x).logits, fresh, rtol=0, atol=1e-6)
    adapter.reset()
    torch.testing.assert_close(adapter(x).logits, fresh, rtol=0, atol=1e-6)
    for key, value in default_bundle.clip.state_dict().items():
        assert torch.equal(user_state[key], value), key
    for key, value in shared.state_dict().items():
        assert torch.equal(shared_state[key], value), key
    written = [k for k, t in _named_tensors(shared) if k in versions and t._version != versions[k]]
    assert not written, f"{name} wrote shared tensors in place: {written}"
    # the big frozen tensors are the backbone's own storage; adapted ones are copies
    own = dict(adapter.method.model.named_parameters())
    base = dict(shared.named_parameters())
    assert "clip.token_embedding.weight" not in adapted  # the largest tensor: always shared
    for key in ("clip.token_embedding.weight", "clip.visual.conv1.weight"):
        if key not in adapted:
            assert own[key].data_ptr() == base[key].data_ptr(), key
    for key in adapted:
        if key in own and key in base:
            assert own[key].data_ptr() != base[key].data_ptr(), key


def test_a_reset_in_one_session_never_breaks_a_backward_in_flight_in_another(
    default_bundle, shifted
):
    """The serve race, step by step: session A's forward saved the shared class embeddings
    for its backward; session B resets; A's backward must still run (it failed with
    'modified by an inplace operation' when reset wrote every buffer back)."""
    x, _ = shifted
    a = Adapter.from_bundle(default_bundle, dataset="digits", method="tent", device="cpu")
    b = a.spawn()
    b(x)
    logits = a.method.model(x)
    b.reset()
    logits.softmax(-1).max(-1).values.sum().backward()
    assert any(p.grad is not None for p in a.method.params)


def test_only_what_the_method_adapts_is_copied(default_bundle):
    tent = Adapter.from_bundle(default_bundle, dataset="digits", method="tent", device="cpu")
    assert tent.backbone.adapted and all(".ln" in n or "ln_" in n for n in tent.backbone.adapted), (
        tent.backbone.adapted
    )
    mura = Adapter.from_bundle(default_bundle, dataset="digits", method="mura", device="cpu")
    assert mura.backbone.adapted == []  # adapters sit beside the frozen layers
    for a in (tent, mura):
        assert 0 < a.state_bytes() < a.backbone.model_bytes / 10


def test_from_open_clip_equals_the_bundle_path(default_bundle, digits_stream, shifted):
    x, _ = shifted
    bundle = default_bundle
    mine = Adapter.from_open_clip(
        bundle.clip,
        bundle.tokenizer,
        digits_stream.classnames,
        digits_stream.templates,
        method="tent",
        overrides={"steps": 2},
        mean=bundle.preprocess.mean,
        std=bundle.preprocess.std,
    )
    assert mine.image_size == 32  # read from the model's open_clip preprocess config
    ref = Adapter.from_bundle(
        bundle,
        digits_stream.classnames,
        digits_stream.templates,
        method="tent",
        overrides=["steps=2"],
        device="cpu",
    )
    for _ in range(2):
        torch.testing.assert_close(mine(x).logits, ref(x).logits, rtol=0, atol=1e-6)
    assert mine.config.steps == 2


def test_preprocess_resizes_and_crops_as_the_harness_decodes(tmp_path, default_bundle):
    from PIL import Image

    from tta_bench.run.cache import to_rgb_array

    adapter = Adapter.from_bundle(default_bundle, dataset="digits", device="cpu")
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (48, 40, 3), dtype=np.uint8))
    img.save(tmp_path / "a.png")
    want = torch.from_numpy(np.array(to_rgb_array(img, 32))).permute(2, 0, 1).float() / 255
    from_path = adapter.preprocess(tmp_path / "a.png")
    from_pil = adapter.preprocess([img, img])
    assert from_path.shape == (1, 3, 32, 32) and from_pil.shape == (2, 3, 32, 32)
    torch.testing.assert_close(from_path[0], want, rtol=0, atol=0)
    torch.testing.assert_close(from_pil[1], want, rtol=0, atol=0)
    pred = adapter([tmp_path / "a.png", img])  # PIL images and paths go through preprocess
    torch.testing.assert_close(pred.logits[0], pred.logits[1], rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("images", "message"),
    [
        (torch.rand(2, 3, 40, 40), r"expected float images \[B, 3, 32, 32\].*preprocess"),
        (torch.rand(2, 3, 32, 32) * 255, r"expected images in \[0, 1\]"),
        (torch.zeros(2, 3, 32, 32, dtype=torch.uint8), "divide uint8 by 255"),
    ],
)
def test_adapter_rejects_bad_images(default_bundle, images, message):
    adapter = Adapter.from_bundle(default_bundle, dataset="digits", device="cpu")
    with pytest.raises(ValueError, match=message):
        adapter(images)


def test_method_overrides_are_validated():
    cfg = method_config("mura", {"ranks": [2, 4], "lr": 1e-3})
    assert cfg.ranks == [2, 4] and cfg.lr == 1e-3
    assert method_config("mura", ["method.ranks=[2,4]", "steps=3"]).steps == 3
    with pytest.raises(ValueError, match="unknown mura option.*'rank'; known: .*ranks"):
        method_config("mura", {"rank": 4})
    with pytest.raises(ValueError, match="bad mura option.*steps"):
        method_config("mura", {"steps": "many"})
    with pytest.raises(ValueError, match="key=value"):
        method_config("tent", ["steps"])
    with pytest.raises(ValueError, match=r"\(none: the method has no options\)"):
        method_config("zeroshot", {"lr": 1})


def test_prediction_top_k_and_records(default_bundle, test_images):
    x, y = test_images
    adapter = Adapter.from_bundle(default_bundle, dataset="digits", device="cpu")
    pred = adapter(x[:4])
    tops = pred.top_k(3)
    assert [len(t) for t in tops] == [3] * 4
    rows = pred.records(30)  # capped at the number of classes
    for row, top, label, score in zip(rows, tops, pred.labels, pred.scores):
        assert row["label"] == label == top[0][0] and len(row["top_k"]) == 10
        assert row["score"] == pytest.approx(float(score)) == pytest.approx(top[0][1])
    assert (pred.indices == y[:4]).float().mean() >= 0.75
