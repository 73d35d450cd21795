"""Loading the stream: batches mixing domains of several sources keep every image with its
label, skipped rows leave images and labels alike, and worker processes change nothing."""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest
import torch

from tta_bench.data import BadImageError
from tta_bench.registry import registry
from tta_bench.run.loader import LoaderSettings, StreamBatches, make_loader
from tta_bench.run.sources import ArraySource, DecodingSource
from tta_bench.run.stream import Batch

from .helpers import run, scores


def _array_source(tag: int, n: int = 6, size: int = 16) -> ArraySource:
    """Image ``i`` of this source: every pixel ``tag * 10 + i`` (which source, which row)."""
    images = np.empty((n, size, size, 3), dtype=np.uint8)
    for i in range(n):
        images[i] = tag * 10 + i
    return ArraySource(f"array-{tag}", images)


def _synthetic(**kwargs):
    return registry("datasets").get("synthetic")(per_class=2, **kwargs)


def test_a_mixed_batch_gathers_each_row_from_its_domains_source():
    sources = [_array_source(1), _array_source(2)]
    labels = [np.array([0, 1, 2, 3, 0, 1]), np.array([3, 3, 2, 2, 1, 1])]
    batch = Batch(0, np.array([4, 0, 5, 1, 2]), np.array([1, 0, 0, 1, 1]), False, 0)
    item = StreamBatches([batch], sources, [0, 1], labels)[0]
    assert item["images"][:, 0, 0, 0].tolist() == [24, 10, 15, 21, 22]  # tag * 10 + row
    assert item["labels"].tolist() == [1, 0, 1, 3, 2]
    assert item["kept"].tolist() == [0, 1, 2, 3, 4] and item["bad"] == []
    assert item["number"] == 0


def test_skipped_rows_leave_images_and_labels_alike():
    stream = _synthetic(corrupt=[1, 6])
    sources = [_array_source(1), DecodingSource(stream, 16, on_bad_image="skip")]
    labels = [np.array([0, 1, 2, 3, 0, 1]), stream.labels]
    # rows (domain, index): (1, 1) bad, (0, 3), (1, 0), (1, 6) bad, (0, 5), (1, 2)
    batch = Batch(3, np.array([1, 3, 0, 6, 5, 2]), np.array([1, 0, 1, 1, 0, 1]), False, 0)
    item = StreamBatches([batch], sources, [0, 1], labels)[0]
    assert item["kept"].tolist() == [1, 2, 4, 5]
    assert item["labels"].tolist() == [3, stream.labels[0], 1, stream.labels[2]]
    assert sorted(b["index"] for b in item["bad"]) == [1, 6]
    clean = DecodingSource(_synthetic(), 16).fetch(np.array([0, 2])).images
    images = item["images"]
    assert images.shape == (4, 16, 16, 3)
    assert (images[0] == 13).all() and (images[2] == 15).all()
    assert torch.equal(images[1], torch.from_numpy(clean[0]))
    assert torch.equal(images[3], torch.from_numpy(clean[1]))


def test_worker_processes_yield_the_same_batches_in_the_same_order():
    stream = _synthetic(corrupt=[5])
    sources = [DecodingSource(stream, 16, on_bad_image="skip"), _array_source(3, n=8)]
    labels = [stream.labels, np.arange(8) % 4]
    rng = np.random.default_rng(0)
    batches = [
        Batch(k, rng.permutation(8)[:5], rng.integers(0, 2, size=5), False, 0) for k in range(6)
    ]
    data = StreamBatches(batches, sources, [0, 1], labels)
    inline = list(make_loader(data, LoaderSettings(0, False, None, False)))
    workers = list(make_loader(data, LoaderSettings(2, False, 2, False), seed=0))
    assert [i["number"] for i in workers] == list(range(6))
    for a, b in zip(inline, workers):
        assert torch.equal(a["images"], b["images"]) and torch.equal(a["labels"], b["labels"])
        assert torch.equal(a["kept"], b["kept"]) and a["bad"] == b["bad"]
    assert any(item["bad"] for item in inline)  # the bad image was in the stream


def test_mixed_domains_from_two_dataset_served_sources_score_their_own_images(tmp_path):
    record = run(tmp_path / "r.json", "colour_oracle", "tiny-domains", seeds=[0])
    assert record["loop"]["sources"] == ["decoded"] * 4  # one split per domain
    assert len(record["cells"]) == 4
    for cell in record["cells"]:
        assert cell["n"] == 12 and cell["accuracy"] == 1.0


def test_workers_change_no_number_of_a_run(tmp_path):
    kwargs = {"cache": "never", "dataset_args": {"split": "test", "per_class": 3, "corrupt": [4]}}
    kwargs["on_bad_image"] = "skip"
    inline = run(
        tmp_path / "w0.json", "norm_tent", "tiny-domains", loader={"num_workers": 0}, **kwargs
    )
    workers = run(
        tmp_path / "w2.json", "norm_tent", "tiny-domains", loader={"num_workers": 2}, **kwargs
    )
    assert workers["loop"]["loader"]["num_workers"] == 2
    assert scores(inline) == scores(workers)
    assert all(c["n"] == 11 for c in inline["cells"])  # row 4 of every domain is unreadable


def test_skipped_images_of_a_mixed_stream_are_reported_by_split_under_every_policy(tmp_path):
    dataset_args = {"split": "test", "per_class": 3, "corrupt": [4]}
    reports = {}
    for policy in ("always", "never"):
        record = run(
            tmp_path / f"{policy}.json",
            "colour_oracle",
            "tiny-domains",
            cache=policy,
            on_bad_image="skip",
            dataset_args=dataset_args,
        )
        assert all(c["n"] == 11 and c["accuracy"] == 1.0 for c in record["cells"]), policy
        reports[policy] = {
            name: sorted(b["index"] for b in bad) for name, bad in record["skipped_images"].items()
        }
    expected = {f"synthetic-test-{s}-{v}": [4] for s in ("bright", "dark") for v in (1, 2)}
    assert reports["always"] == expected
    assert reports["never"] == expected, reports["never"]


def test_a_failed_run_leaves_no_loader_worker_behind(tmp_path):
    with pytest.raises(BadImageError, match="cannot be decoded"):
        run(
            tmp_path / "r.json",
            "zeroshot",
            "tiny-domains",
            cache="never",
            loader={"num_workers": 1},
            dataset_args={"split": "test", "per_class": 3, "corrupt": [4]},
        )
    assert multiprocessing.active_children() == [], "a loader worker outlived the failed run"


class _SignalsSeen:
    """One item per batch: what the process reading it does on SIGUSR2 and SIGINT."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, k: int) -> dict:
        import os
        import signal

        usr2, sigint = signal.getsignal(signal.SIGUSR2), signal.getsignal(signal.SIGINT)
        return {"pid": os.getpid(), "usr2": getattr(usr2, "name", str(usr2)), "int": sigint}


def test_a_worker_leaves_the_signals_handled_in_python_to_the_main_process():
    """A scheduler signals every process of a job: SLURM's preemption signal (SIGUSR2, which
    submitit handles in Python) ran submitit's checkpoint in a forked loader worker too,
    over the main process's temporary file. A worker ignores what the main process
    handles; Python's Ctrl-C handler stays."""
    import os
    import signal

    def preempted(signum, frame):  # stands in for submitit's handler
        raise AssertionError("a worker ran the main process's handler")

    previous = signal.signal(signal.SIGUSR2, preempted)
    # Python's Ctrl-C handler, as an interactive run has it: a process started in a
    # shell's background job inherits SIGINT ignored, and Python then installs none.
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        items = list(make_loader(_SignalsSeen(), LoaderSettings(1, False, 2, False), seed=0))
        assert signal.getsignal(signal.SIGUSR2) is preempted  # the main process's, kept
    finally:
        signal.signal(signal.SIGUSR2, previous)
        signal.signal(signal.SIGINT, previous_int)
    assert [item["pid"] != os.getpid() for item in items] == [True, True]
    assert [item["usr2"] for item in items] == ["SIG_IGN", "SIG_IGN"]
    assert all(item["int"] is signal.default_int_handler for item in items)
