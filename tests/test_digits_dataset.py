"""The default dataset's streams (``mura_plugin.datasets.digits``): every call gives the same
images and labels, of the whole split or of chosen classes relabelled in their order, and
the HF dataset behind them is built once per process and left unchanged by its users."""

from __future__ import annotations

import numpy as np
import pytest

from mura_plugin.datasets import digits as dg


@pytest.mark.parametrize(("split", "classes"), [("test", None), ("train", None), ("test", [7, 2])])
def test_each_call_gives_the_split_and_one_dataset_serves_them(split, classes):
    images, labels = dg.digits_arrays(split)
    if classes is not None:
        keep = np.isin(labels, classes)
        images = images[keep]
        labels = np.asarray([classes.index(int(y)) for y in labels[keep]])
    first = dg.digits(split=split, classes=classes)
    second = dg.digits(split=split, classes=classes)
    assert first.dataset is second.dataset and first is not second
    assert len(first.dataset) == len(labels)
    assert first.dataset["label"] == labels.tolist()
    for i in (0, len(labels) // 2, len(labels) - 1):
        assert np.array_equal(np.asarray(first.dataset[i]["image"]), images[i])
    # what the harness does with a stream's dataset leaves the shared one as it was
    first.dataset.select(range(3)).cast_column("label", first.dataset.features["label"])
    assert np.array_equal(first.dataset.with_format("numpy")[:]["label"], labels)
    assert dg.digits(split=split, classes=classes).dataset.format["type"] is None


def test_chosen_classes_name_their_own_classes():
    every = dg.digits(split="test")
    two = dg.digits(split="test", classes=[7, 2])
    assert two.classnames == [every.classnames[7], every.classnames[2]]
    assert two.dataset.features["label"].names == two.classnames
    assert two.fingerprint.endswith("/classes=7,2") and two.dataset is not every.dataset
