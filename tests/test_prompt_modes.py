"""The protocol's prompt modes (``tta_bench.prompts``): ``protocol.text_head=cupl|all`` with a
JSON of class -> sentences (CuPL's format) beside the templates head. The head's value
against a reference computed here, its id (the file's content, never its path), every
method either running under a sentence head or refused before anything is built, and the
CLI end to end."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from method_runs import build_with_source, cheap_config
from test_method_contract import _digits_source

from tta_bench.cli import main
from tta_bench.model import ZeroShotClassifier
from tta_bench.prompts import class_prompt_lists, identity, load_class_prompts
from tta_bench.registry import registry
from tta_bench.run.protocol import load_protocol
from tta_bench.text_head import encode_prompt_lists

SMALL = ["protocol.shifts=[contrast]", "protocol.max_images=40", "seeds=[0]", "--quiet"]


def _sentences(classnames):
    """Two sentences per class, worded unlike the templates but in the tiny model's
    vocabulary (one class with three)."""
    out = {c: [f"a blurry photo of the number {c}.", f"the digit {c}."] for c in classnames}
    out[classnames[0]].append(f"a handwritten number {classnames[0]}.")
    return out


@pytest.fixture()
def cupl_file(tmp_path, digits_stream):
    path = tmp_path / "cupl.json"
    path.write_text(json.dumps(_sentences(list(digits_stream.classnames))))
    return path


def _reference_head(bundle, lists):
    """Per class: normalised mean of the normalised text features of its prompts, one
    encode_text call per prompt (no chunking, no cut)."""
    rows = []
    with torch.no_grad():
        for prompts in lists:
            feats = torch.cat([bundle.clip.encode_text(bundle.tokenizer([p])) for p in prompts])
            feats = feats / feats.norm(dim=-1, keepdim=True)
            mean = feats.float().mean(dim=0)
            rows.append(mean / mean.norm())
    return torch.stack(rows)


@pytest.mark.parametrize("chunk", [1, 3, 256])
def test_a_sentence_head_is_the_mean_of_each_class_own_prompts(
    default_bundle, digits_stream, chunk
):
    names = list(digits_stream.classnames)
    lists = class_prompt_lists(names, ["a photo of a {}."], _sentences(names))
    assert lists[0][0] == f"a photo of a {names[0]}." and len(lists[0]) == 4
    got = encode_prompt_lists(
        default_bundle.clip, default_bundle.tokenizer, lists, chunk_size=chunk
    )
    torch.testing.assert_close(
        got.float(), _reference_head(default_bundle, lists), atol=2e-6, rtol=0
    )


def test_sentences_equal_to_the_templates_give_the_templates_head(default_bundle, digits_stream):
    names, templates = list(digits_stream.classnames), list(digits_stream.templates)
    as_sentences = {c: [t.format(c) for t in templates] for c in names}
    by_templates = ZeroShotClassifier(default_bundle, names, templates, text_cache=False)
    by_sentences = ZeroShotClassifier(
        default_bundle, names, [], text_cache=False, class_prompts=as_sentences
    )
    torch.testing.assert_close(
        by_sentences.class_embeddings, by_templates.class_embeddings, atol=2e-6, rtol=0
    )


def test_all_is_templates_then_sentences_and_differs_from_either(default_bundle, digits_stream):
    names, templates = list(digits_stream.classnames), list(digits_stream.templates)
    sentences = _sentences(names)
    heads = {
        "templates": ZeroShotClassifier(default_bundle, names, templates, text_cache=False),
        "cupl": ZeroShotClassifier(
            default_bundle, names, [], text_cache=False, class_prompts=sentences
        ),
        "all": ZeroShotClassifier(
            default_bundle, names, templates, text_cache=False, class_prompts=sentences
        ),
    }
    lists = [[t.format(c) for t in templates] + sentences[c] for c in names]
    reference = _reference_head(default_bundle, lists)
    torch.testing.assert_close(heads["all"].class_embeddings.float(), reference, atol=2e-6, rtol=0)
    for other in ("templates", "cupl"):
        assert (heads["all"].class_embeddings - heads[other].class_embeddings).abs().max() > 1e-3


def test_a_cached_sentence_head_is_the_computed_one_and_keyed_by_the_sentences(
    default_bundle, digits_stream, tmp_cache
):
    names = list(digits_stream.classnames)
    sentences = _sentences(names)
    first = ZeroShotClassifier(default_bundle, names, [], class_prompts=sentences)
    again = ZeroShotClassifier(default_bundle, names, [], class_prompts=sentences)
    assert torch.equal(first.class_embeddings, again.class_embeddings)
    edited = {**sentences, names[1]: ["a photo of the number two."]}
    other = ZeroShotClassifier(default_bundle, names, [], class_prompts=edited)
    assert not torch.equal(other.class_embeddings[1], first.class_embeddings[1])
    assert torch.equal(other.class_embeddings[2], first.class_embeddings[2])


def test_the_id_holds_the_content_not_the_path(cupl_file, tmp_path):
    default = load_protocol("digits-c")
    assert default.text_head is None and "text_head" not in default.identity()
    cupl = load_protocol("digits-c", text_head="cupl", prompts=str(cupl_file))
    assert "-cupl-" in cupl.id and cupl.id != default.id
    elsewhere = tmp_path / "moved" / "other-name.json"
    elsewhere.parent.mkdir()
    shutil.copy(cupl_file, elsewhere)
    # re-serialised with other whitespace and key order: the same content
    data = json.loads(elsewhere.read_text())
    elsewhere.write_text(json.dumps(dict(reversed(list(data.items()))), indent=4))
    assert load_protocol("digits-c", text_head="cupl", prompts=str(elsewhere)).id == cupl.id
    assert load_protocol("digits-c", text_head="all", prompts=str(cupl_file)).id not in (
        cupl.id,
        default.id,
    )
    data[next(iter(data))][0] += " (edited)"
    elsewhere.write_text(json.dumps(data))
    assert load_protocol("digits-c", text_head="cupl", prompts=str(elsewhere)).id != cupl.id
    assert load_protocol("digits-c", text_head="templates").id == default.id


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        ("{not json", "not readable JSON"),
        ("[]", "non-empty JSON object"),
        ('{"zero": []}', "non-empty list"),
        ('{"zero": ["ok", 3]}', "non-empty list"),
        ('{"zero": "a photo"}', "non-empty list"),
    ],
)
def test_a_bad_prompts_file_is_refused_naming_it(tmp_path, content, message):
    path = tmp_path / "p.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message) as err:
        load_class_prompts(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"text_head": "cupl"}, "protocol.prompts=FILE"),
        ({"text_head": "cpl", "prompts": "FILE"}, "did you mean 'cupl'"),
        ({"prompts": "FILE"}, "read only by protocol.text_head=cupl"),
    ],
)
def test_inconsistent_prompt_settings_are_refused(cupl_file, overrides, message):
    overrides = {k: str(cupl_file) if v == "FILE" else v for k, v in overrides.items()}
    with pytest.raises(ValueError, match=message):
        load_protocol("digits-c", **overrides)


def _sentence_classifier(bundle, stream, mode):
    names = list(stream.classnames)
    templates = list(stream.templates) if mode == "all" else []
    return ZeroShotClassifier(bundle, names, templates, class_prompts=_sentences(names))


@pytest.mark.parametrize("name", registry("methods").names())
def test_every_method_runs_under_a_sentence_head_or_declares_it_cannot(
    name, default_bundle, digits_stream, test_images
):
    from tta_bench.prompts import check_method

    method_cls = registry("methods").get(name)
    if "cupl" not in method_cls.text_heads:
        assert method_cls.text_heads == ("templates",)
        with pytest.raises(ValueError, match=f"method {name!r} encodes prompts"):
            check_method(name, method_cls, "cupl")
        return
    check_method(name, method_cls, "cupl")
    classifier = _sentence_classifier(default_bundle, digits_stream, "cupl")
    method = build_with_source(method_cls, classifier, cheap_config(method_cls), _digits_source)
    method.reseed(0)
    logits = method.step(test_images[0][:4])
    assert logits.shape == (4, len(digits_stream.classnames))
    assert torch.isfinite(logits).all()


def test_a_run_under_cupl_records_the_prompts_and_scores_otherwise(cupl_file, tmp_path):
    outs = {}
    for mode in ("templates", "cupl"):
        out = tmp_path / f"run-{mode}.json"
        extra = (
            []
            if mode == "templates"
            else ["protocol.text_head=cupl", f"protocol.prompts={cupl_file}"]
        )
        assert main(["run", "--method", "zeroshot", *SMALL, *extra, "--output", str(out)]) == 0
        outs[mode] = json.loads(out.read_text())
    protocol = outs["cupl"]["protocol"]
    assert protocol["text_head"] == "cupl"
    assert protocol["prompts"] == identity(load_class_prompts(cupl_file))
    assert protocol["id"] != outs["templates"]["protocol"]["id"]
    (a,), (b,) = outs["templates"]["cells"], outs["cupl"]["cells"]
    assert a["n"] == b["n"] == 40


def test_a_run_is_refused_before_anything_is_written(cupl_file, tmp_path, capsys):
    out = tmp_path / "r.json"
    cupl = ["protocol.text_head=cupl", f"protocol.prompts={cupl_file}"]
    assert main(["run", "--method", "tpt", *SMALL, *cupl, "--output", str(out)]) == 2
    assert "supports protocol.text_head templates" in capsys.readouterr().err
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"zero": ["a zero."]}))
    cupl = ["protocol.text_head=cupl", f"protocol.prompts={partial}"]
    assert main(["run", "--method", "zeroshot", *SMALL, *cupl, "--output", str(out)]) == 2
    assert "has no sentences for" in capsys.readouterr().err
    assert not any(tmp_path.glob("r.json*"))
