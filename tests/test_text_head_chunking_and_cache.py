"""Text heads at any size: chunked prompt encoding and the on-disk cache of class embeddings.

A real (tiny, random) open_clip text tower with open_clip's own tokenizer; the model's
``encode_text`` is wrapped per instance to record every call's tokens and features (what
the text tower was asked to do), never our code.
"""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tta_bench import text_head
from tta_bench.catalog import catalog
from tta_bench.model import ModelBundle, Preprocess, ZeroShotClassifier

U = 2.0**-24  # float32 unit roundoff


def tiny_text_clip(seed: int = 0, width: int = 32, layers: int = 1) -> torch.nn.Module:
    """An open_clip CLIP with a small text tower at CLIP's 77-token context, random weights."""
    from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg

    torch.manual_seed(seed)
    vision = CLIPVisionCfg(layers=1, width=32, head_width=16, patch_size=16, image_size=32)
    text = CLIPTextCfg(context_length=77, width=width, heads=2, layers=layers)
    return CLIP(embed_dim=32, vision_cfg=vision, text_cfg=text).eval()


@pytest.fixture(scope="module")
def tokenizer():
    import open_clip

    return open_clip.get_tokenizer("ViT-B-32")


@pytest.fixture(scope="module")
def clip():
    return tiny_text_clip()


@pytest.fixture(scope="module")
def imagenet():
    cat = catalog()
    return list(cat["datasets"]["imagenet"]["classnames"]), list(
        cat["templates"]["clip-imagenet-80"]["templates"]
    )


class Recorder:
    """Wraps the head's text encoder (``text_head.encode_text_cut``, which runs the
    tower): records each call's tokens and output."""

    def __init__(self, clip: torch.nn.Module, keep: bool = True):
        self.clip, self.keep = clip, keep
        self.original = text_head.encode_text_cut
        self.tokens: list[torch.Tensor] = []
        self.feats: list[torch.Tensor] = []
        self.batches: list[int] = []

    def __enter__(self) -> Recorder:
        def encode(clip: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
            out = self.original(clip, tokens)
            if clip is self.clip:
                self.batches.append(int(tokens.shape[0]))
                if self.keep:
                    self.tokens.append(tokens.detach().clone())
                    self.feats.append(out.detach().clone())
            return out

        text_head.encode_text_cut = encode
        return self

    def __exit__(self, *exc: object) -> None:
        text_head.encode_text_cut = self.original


def legacy_head(clip, tokenizer, classnames, templates) -> tuple[torch.Tensor, torch.Tensor]:
    """The unchunked computation (one ``encode_text`` call for every prompt), as the
    classifier did before: the head and the normalised per-prompt features ``[C*T, D]``."""
    with torch.no_grad():
        feats = clip.encode_text(tokenizer([t.format(c) for c in classnames for t in templates]))
    feats = feats / feats.norm(dim=-1, keepdim=True)
    head = feats.view(len(classnames), len(templates), -1).mean(dim=1)
    return head / head.norm(dim=-1, keepdim=True), feats


def derived_tolerance(chunked_feats: torch.Tensor, full_feats: torch.Tensor, n_classes: int):
    """Elementwise bound on |chunked head - unchunked head| from the computation itself.

    Both heads are u = s / |s| with s the float32 sum over T templates of unit feature
    vectors a_t (chunked calls) or b_t (one call). The text tower's features differ between
    batch shapes by its own rounding, e_i = sum_t |a_ti - b_ti| (measured on the very
    features each side summed); each float32 sum of T terms, in any order, is off by at most
    gamma * sum_t |x_ti| with gamma = (T - 1) u. So |ds_i| <= E_i = e_i + gamma *
    (sum|a_ti| + sum|b_ti|), and to first order |du_i| <= (E_i + |u_i| |E|_2) / |s|, plus the
    rounding of the mean and the normalisation (the norm of D terms: (D + 2) u relative, on
    each side). Doubled for the second-order terms."""
    d = full_feats.shape[1]
    t = full_feats.shape[0] // n_classes
    a = chunked_feats.double().view(n_classes, t, d)
    b = full_feats.double().view(n_classes, t, d)
    gamma = (t - 1) * U
    big_e = (a - b).abs().sum(1) + gamma * (a.abs().sum(1) + b.abs().sum(1))
    s = b.sum(1)
    s_norm = s.norm(dim=-1, keepdim=True)
    u = (s / s_norm).abs()
    first = (big_e + u * big_e.norm(dim=-1, keepdim=True)) / s_norm
    return 2 * (first + 2 * (d + 2) * U * u + 2 * U)


def normalised(feats: list[torch.Tensor]) -> torch.Tensor:
    f = torch.cat(feats)
    return f / f.norm(dim=-1, keepdim=True)


# -- chunking --------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [1, 7, 80, 241])
def test_chunked_equals_unchunked_within_derived_tolerance(clip, tokenizer, imagenet, chunk):
    names, templates = imagenet[0][:6], imagenet[1]
    ref, full_feats = legacy_head(clip, tokenizer, names, templates)
    with Recorder(clip) as rec:
        head = text_head.encode_class_embeddings(
            clip, tokenizer, names, templates, chunk_size=chunk
        )
    # every prompt encoded once, in class-major order, no call above the chunk size
    assert torch.equal(
        torch.cat(rec.tokens), tokenizer([t.format(c) for c in names for t in templates])
    )
    assert max(rec.batches) <= chunk
    tol = derived_tolerance(normalised(rec.feats), full_feats, len(names))
    diff = (head.double() - ref.double()).abs()
    assert head.shape == ref.shape and head.dtype == torch.float32
    assert bool((diff <= tol).all()), f"max excess {(diff - tol).max().item():.3g}"
    # the tolerance is tight enough to see one template missing from one class's mean
    wrong = ref.clone()
    wrong[0] = full_feats.view(len(names), len(templates), -1)[0, 1:].mean(0)
    wrong[0] /= wrong[0].norm()
    assert not bool(((wrong.double() - ref.double()).abs() <= tol).all())


def test_chunks_are_whole_classes_or_template_slices(clip, tokenizer, imagenet):
    names, templates = imagenet[0][:10], imagenet[1][:7]
    for chunk, expected in [(1, [1] * 70), (7, [7] * 10), (20, [14] * 5), (30, [28, 28, 14])]:
        with Recorder(clip, keep=False) as rec:
            text_head.encode_class_embeddings(clip, tokenizer, names, templates, chunk_size=chunk)
        assert rec.batches == expected, chunk


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, None])
def test_chunk_size_must_be_a_positive_int(clip, tokenizer, bad):
    with pytest.raises(ValueError, match="chunk_size"):
        text_head.encode_class_embeddings(clip, tokenizer, ["cat"], ["a {}."], chunk_size=bad)


# The memory an ImageNet-sized head needs (1,000 classes x 80 templates in chunks, against
# 300 MiB) is a target, measured by benchmarks/text_head_memory.py, not asserted here: the
# chunks, their equality with the unchunked computation and the cache are the tests above
# and below.


# -- the cache -------------------------------------------------------------------------
def entry_files(cache_root) -> list:
    return sorted((cache_root / "text-heads").glob("*.head"))


def test_cache_hit_equals_miss_exactly(clip, tokenizer, imagenet, tmp_cache):
    names, templates = imagenet[0][:20], imagenet[1][:5]
    with Recorder(clip, keep=False) as rec:
        miss = text_head.class_embeddings(clip, tokenizer, names, templates)
    assert rec.batches and len(entry_files(tmp_cache)) == 1
    with Recorder(clip, keep=False) as rec:
        hit = text_head.class_embeddings(clip, tokenizer, names, templates)
    assert rec.batches == []  # nothing encoded
    assert torch.equal(hit, miss) and hit.dtype == miss.dtype
    direct = text_head.encode_class_embeddings(clip, tokenizer, names, templates)
    assert torch.equal(direct, miss)


def test_cache_off_by_argument_or_environment(clip, tokenizer, tmp_cache, monkeypatch):
    text_head.class_embeddings(clip, tokenizer, ["cat", "dog"], ["a {}."], cache=False)
    assert entry_files(tmp_cache) == []
    monkeypatch.setenv(text_head.CACHE_ENV, "off")
    text_head.class_embeddings(clip, tokenizer, ["cat", "dog"], ["a {}."])
    assert entry_files(tmp_cache) == []
    monkeypatch.setenv(text_head.CACHE_ENV, "1")
    text_head.class_embeddings(clip, tokenizer, ["cat", "dog"], ["a {}."])
    assert len(entry_files(tmp_cache)) == 1


def test_unusable_cache_directory_still_gives_the_head(clip, tokenizer, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("TTA_BENCH_CACHE", str(blocker / "cache"))
    with pytest.warns(UserWarning, match="not cached"):
        head = text_head.class_embeddings(clip, tokenizer, ["cat", "dog"], ["a {}."])
    direct = text_head.encode_class_embeddings(clip, tokenizer, ["cat", "dog"], ["a {}."])
    assert torch.equal(head, direct)


def test_key_changes_with_each_input(tokenizer, monkeypatch):
    from open_clip.tokenizer import SimpleTokenizer

    model = tiny_text_clip(seed=2)
    names, templates = ["cat", "dog", "tabby cat"], ["a photo of a {}.", "art of the {}."]

    def digest(m=model, tok=tokenizer, n=names, t=templates, chunk=256) -> str:
        return text_head.key_digest(text_head.head_key(m, tok, n, t, chunk_size=chunk))

    base = digest()
    assert digest() == base  # stable
    variants = {
        "class names": digest(n=["cat", "dog", "tiger cat"]),
        "class order": digest(n=["dog", "cat", "tabby cat"]),
        "templates": digest(t=["a photo of a {}.", "a sketch of the {}."]),
        "template order": digest(t=templates[::-1]),
        "tokenizer": digest(tok=SimpleTokenizer(context_length=16)),
        "chunk size": digest(chunk=64),
        "other weights": digest(m=tiny_text_clip(seed=3)),
    }
    monkeypatch.setattr(text_head, "RECIPE_VERSION", text_head.RECIPE_VERSION + 1)
    variants["recipe version"] = digest()
    monkeypatch.undo()
    # every text-side tensor of the state counts, changed in place (the memo must notice)
    text_names = [n for n, _ in model.state_dict().items() if not n.startswith("visual.")]
    assert {"token_embedding.weight", "positional_embedding", "text_projection"} <= set(text_names)
    for name in (
        "token_embedding.weight",
        "transformer.resblocks.0.mlp.c_fc.bias",
        "ln_final.weight",
        "text_projection",
    ):
        tensor = dict(model.named_parameters())[name]
        old = tensor.view(-1)[0].item()
        with torch.no_grad():
            tensor.view(-1)[0] += 1.0
        variants[f"weight {name}"] = digest()
        with torch.no_grad():
            tensor.view(-1)[0] = old
        assert digest() == base  # the same bytes again
    assert len(set(variants.values())) == len(variants) and base not in variants.values()
    # image-side weights and the logit scale do not change the text head: one entry serves
    # every adapted copy of the vision tower
    with torch.no_grad():
        model.visual.conv1.weight.add_(1.0)
        model.logit_scale.add_(1.0)
    assert digest() == base


def test_text_hash_is_memoised_per_module(monkeypatch):
    model = tiny_text_clip(seed=4)
    first = text_head.text_state_sha256(model)
    calls = []
    original = text_head.hashlib.sha256
    monkeypatch.setattr(text_head.hashlib, "sha256", lambda *a: calls.append(1) or original(*a))
    assert text_head.text_state_sha256(model) == first and calls == []
    model.load_state_dict(tiny_text_clip(seed=5).state_dict())
    assert text_head.text_state_sha256(model) != first and calls


def test_vocabulary_hash_is_memoised_per_shared_vocabulary(monkeypatch):
    """Tokenizers built per model around one shared tokenizer (the shipped tiny model's
    bundles) hash its vocabulary once; a vocabulary that grows is hashed again."""
    from open_clip.tokenizer import SimpleTokenizer

    class Wrapper:  # a bundle's tokenizer: forwards to the shared one
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

    shared = SimpleTokenizer(context_length=16)
    first = text_head._vocab_sha256(Wrapper(shared))
    calls = []
    original = text_head.hashlib.sha256
    monkeypatch.setattr(text_head.hashlib, "sha256", lambda *a: calls.append(1) or original(*a))
    assert text_head._vocab_sha256(Wrapper(shared)) == first and calls == []
    shared.encoder["zzz-new-token</w>"] = len(shared.encoder)
    assert text_head._vocab_sha256(Wrapper(shared)) != first and calls == [1]
    # another tokenizer with an equal vocabulary: hashed, to the same digest
    assert text_head._vocab_sha256(SimpleTokenizer(context_length=16)) == first


def test_text_hash_takes_zero_dim_tensors():
    model = torch.nn.Module()
    model.temperature = torch.nn.Parameter(torch.tensor(0.5))  # 0-d, text side
    before = text_head.text_state_sha256(model)
    with torch.no_grad():
        model.temperature.fill_(0.25)
    assert text_head.text_state_sha256(model) != before


def corrupt_by(kind: str, path) -> None:
    data = bytearray(path.read_bytes())
    if kind == "truncated":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif kind == "payload bit flip":
        data[-5] ^= 0x10
        path.write_bytes(bytes(data))
    elif kind == "garbage":
        path.write_bytes(b"\x00" * 64)
    elif kind == "empty":
        path.write_bytes(b"")


@pytest.mark.parametrize("kind", ["truncated", "payload bit flip", "garbage", "empty"])
def test_corrupt_entry_is_recomputed_not_trusted(clip, tokenizer, imagenet, tmp_cache, kind):
    names, templates = imagenet[0][:8], imagenet[1][:3]
    good = text_head.class_embeddings(clip, tokenizer, names, templates)
    (path,) = entry_files(tmp_cache)
    corrupt_by(kind, path)
    with Recorder(clip, keep=False) as rec, pytest.warns(UserWarning, match="corrupt"):
        again = text_head.class_embeddings(clip, tokenizer, names, templates)
    assert rec.batches  # recomputed
    assert torch.equal(again, good)
    with Recorder(clip, keep=False) as rec:  # and the entry is whole again
        assert torch.equal(text_head.class_embeddings(clip, tokenizer, names, templates), good)
    assert rec.batches == []


def test_entry_holding_another_key_is_not_trusted(clip, tokenizer, tmp_cache):
    a = text_head.class_embeddings(clip, tokenizer, ["cat", "dog"], ["a {}."])
    text_head.class_embeddings(clip, tokenizer, ["owl", "emu"], ["a {}."])
    first, second = entry_files(tmp_cache)
    # put one head's file under the other's name
    keep = first.read_bytes()
    first.write_bytes(second.read_bytes())
    second.write_bytes(keep)
    with pytest.warns(UserWarning, match="key differs"):
        b = text_head.class_embeddings(clip, tokenizer, ["cat", "dog"], ["a {}."])
    assert torch.equal(a, b)


def _worker(model, names, templates, queue) -> None:
    from tta_bench import text_head as th

    torch.set_num_threads(1)
    calls = []
    original = th.encode_text_cut
    th.encode_text_cut = lambda clip, tokens: calls.append(1) or original(clip, tokens)
    head = th.class_embeddings(model, open_tokenizer(), names, templates)
    queue.put((len(calls), head.numpy().tobytes()))


def open_tokenizer():
    import open_clip

    return open_clip.get_tokenizer("ViT-B-32")


def test_concurrent_writers_compute_once_and_never_corrupt(clip, imagenet, tmp_cache):
    names, templates = imagenet[0][:40], imagenet[1][:8]
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(clip, names, templates, queue)) for _ in range(3)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert sorted(n > 0 for n, _ in results) == [False, False, True]  # one computed it
    assert len({blob for _, blob in results}) == 1
    (path,) = entry_files(tmp_cache)
    hit = text_head.class_embeddings(clip, open_tokenizer(), names, templates)
    assert hit.numpy().tobytes() == results[0][1]
    assert list((tmp_cache / "text-heads").glob(".*.tmp")) == []  # no temporary file left


def test_classifier_builds_its_head_through_the_cache(clip, tokenizer, imagenet, tmp_cache):
    bundle = ModelBundle(
        clip=clip,
        tokenizer=tokenizer,
        preprocess=Preprocess(32, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
        name="tiny-text",
        weights="random",
    )
    names, templates = imagenet[0][:30], imagenet[1][:4]
    first = ZeroShotClassifier(bundle, names, templates)
    with Recorder(clip, keep=False) as rec:
        second = ZeroShotClassifier(bundle, names, templates)
        official = second.encode_templates(templates[:1])
    assert torch.equal(first.class_embeddings, second.class_embeddings)
    assert rec.batches == [30]  # only the new single-template head was encoded
    direct = text_head.encode_class_embeddings(clip, tokenizer, names, templates[:1])
    assert torch.equal(official, direct)
    (entry,) = [e for e in text_head.text_head_entries() if e["templates"] == 4]
    assert entry["about"] == {"model": "tiny-text", "weights": "random"}
    with Recorder(clip, keep=False) as rec:
        ZeroShotClassifier(bundle, names, templates, text_cache=False, text_chunk_size=16)
    assert rec.batches == [16] * 7 + [8]


def test_entries_and_clear(clip, tokenizer, tmp_cache):
    text_head.class_embeddings(clip, tokenizer, ["cat", "dog"], ["a {}.", "the {}."])
    text_head.class_embeddings(clip, tokenizer, ["owl", "emu", "yak"], ["a {}."])
    (tmp_cache / "text-heads" / "broken.head").write_bytes(b"nonsense")
    entries = text_head.text_head_entries()
    assert len(entries) == 3
    by_shape = {(e["classes"], e["templates"]): e for e in entries if e["ok"]}
    assert set(by_shape) == {(2, 2), (3, 1)}
    for e in entries:
        assert e["bytes"] == Path(e["path"]).stat().st_size
    assert [e["ok"] for e in entries if e["path"].endswith("broken.head")] == [False]
    assert by_shape[(2, 2)]["device"].startswith("cpu:")
    removed = text_head.clear_text_heads()
    assert len(removed) == 3 and text_head.text_head_entries() == []
    assert list((tmp_cache / "text-heads").iterdir()) == []  # lock files too


def test_listing_and_clearing_do_not_import_torch(tmp_cache):
    code = (
        "import sys; from tta_bench import text_head as t; "
        "print(len(t.text_head_entries()), len(t.clear_text_heads())); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["0", "0"]


@pytest.mark.parametrize("arch", ["tiny", "ViT-B-32"])
def test_cut_prompts_equal_the_full_forward(arch, default_bundle):
    """encode_text_cut (sequences cut after the longest end token) equals encode_text up
    to float32 summation order, on the default model and on a random ViT-B-32 text tower
    (77-token context), and is used by the class-embedding computation."""
    import open_clip

    from tta_bench.text_head import encode_text_cut

    if arch == "tiny":
        clip, tok = default_bundle.clip, default_bundle.tokenizer
        prompts = ["a photo of the digit three.", "the number nine.", "a handwritten one."]
    else:
        torch.manual_seed(0)
        clip = open_clip.create_model(arch).eval()
        tok = open_clip.get_tokenizer(arch)
        prompts = ["a photo of a goldfish.", "itap of a great white shark.", "a tench."]
    tokens = tok(prompts)
    with torch.no_grad():
        full = clip.encode_text(tokens)
        cut = encode_text_cut(clip, tokens)
    assert cut.shape == full.shape
    scale = full.abs().max().item()
    assert (cut - full).abs().max().item() <= 1e-5 * scale
