"""The plugin's label-shift suites (``digits-c-labelshift``: at most 3 of the 10 digit
classes per batch; ``digits-c-imbalanced``: a long-tailed subset, ratio 10) resolve, run
end to end, and left the ids of the other suites where they were; a label-shift policy
without its field is refused by the CLI before anything is built. The streams themselves
are tested in ``harness/tests/test_label_shift_streams.py``."""

from __future__ import annotations

import pytest

from tta_bench.cli import main
from tta_bench.run.protocol import load_protocol

#: The ids of the catalogue's suites before the label-shift policies existed.
OLD_IDS = {
    "digits-c": "digits-c@v2-reset_each_shift-bs64-aaf89f80a3",
    "digits-c-full": "digits-c-full@v2-reset_each_shift-bs64-55c0031c86",
    "digits-c-continual": "digits-c-continual@v2-continual-bs64-a862ebec1a",
    "digits-c-gradual": "digits-c-gradual@v2-gradual-bs64-8dbb7ea79d",
    "digits-c-extra": "digits-c-extra@v2-reset_each_shift-bs64-bb5b119082",
    "digits-open": "digits-open@v1-reset_each_shift-bs64-ood0.5-9e9df626bf",
    "cifar10-c": "cifar10-c@v1-reset_each_shift-bs200-d0fce98566",
    "imagenet-c-5k": "imagenet-c-5k@v1-reset_each_shift-bs64-912e440de6",
    "vlm-15": "vlm-15@v1-reset_each_shift-bs64-e1ce8234ec",
}


def test_the_suites_resolve_and_the_other_ids_hold():
    ls = load_protocol("digits-c-labelshift")
    assert (ls.reset, ls.classes_per_batch, ls.batch_size) == ("label_shift", 3, 64)
    assert ls.id.startswith("digits-c-labelshift@v2-label_shift-k3-bs64-")
    im = load_protocol("digits-c-imbalanced")
    assert (im.reset, im.imbalance_ratio) == ("imbalanced", 10.0)
    assert im.id.startswith("digits-c-imbalanced@v2-imbalanced-r10-bs64-")
    assert {name: load_protocol(name).id for name in OLD_IDS} == OLD_IDS
    # the same data and domains as the default suite
    base = load_protocol("digits-c")
    for p in (ls, im):
        assert (p.dataset, p.shifts, p.severities) == (base.dataset, base.shifts, base.severities)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["protocol.reset=label_shift"], "needs classes_per_batch"),
        (["protocol.reset=imbalanced"], "needs imbalance_ratio"),
        (["protocol.imbalance_ratio=10"], "only applies to reset policy 'imbalanced'"),
    ],
)
def test_the_cli_exits_2_without_the_policy_field(args, words, tmp_path, capsys, monkeypatch):
    from tta_bench.run.inputs import RunInputs

    def built(*_a, **_k):
        raise AssertionError("the run's inputs were built")

    monkeypatch.setattr(RunInputs, "build", built)
    out = tmp_path / "r.json"
    code = main(["run", "--suite", "digits-c", *args, "--quiet", "--output", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and words in err, err
    assert not out.exists()


@pytest.mark.parametrize("suite", ["digits-c-labelshift", "digits-c-imbalanced"])
def test_a_tiny_zeroshot_run_of_each_suite(suite, tmp_path):
    from tta_bench.run import runner
    from tta_bench.run.resolve import resolve_run

    overrides = ["protocol.shifts=[contrast]", "protocol.max_images=40", "seeds=[0]"]
    _, spec = resolve_run(method="zeroshot", suite=suite, overrides=[*overrides, "progress=false"])
    record = runner.run(spec, tmp_path / "r.json")
    (cell,) = record["cells"]
    assert 0.0 <= cell["accuracy"] <= 1.0
    if suite == "digits-c-labelshift":
        assert cell["n"] == 40  # every image of the cell once
    else:
        assert 10 <= cell["n"] < 40  # the kept long-tailed subset, every class kept
