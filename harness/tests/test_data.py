"""The data pipeline: decoded-cache keys follow file contents, one process decodes an entry
while another waits for it, every cache policy gives the same cells, bad images are skipped
alike and reported, and the disk budget is kept."""

from __future__ import annotations

import json
import multiprocessing
import os
import time
import warnings

import numpy as np
import pytest
from filelock import FileLock

from tta_bench.registry import registry
from tta_bench.run import cache, sources

from .helpers import cli, run, scores, write_folder

POLICIES = ("always", "never", "auto")


def _folder_stream(root):
    return registry("datasets").get("folder")(data_dir=str(root))


def _rewrite_same_size(path, value: int) -> None:
    """Overwrite an uncompressed PNG with other pixels: the same byte size."""
    from PIL import Image

    with Image.open(path) as img:
        size = img.size
    Image.new("RGB", size, (value, value, value)).save(path, compress_level=0)


def test_the_cache_key_changes_when_a_file_is_rewritten_at_the_same_size_and_mtime(
    tmp_path, fresh_cache
):
    root = tmp_path / "imgs"
    files = write_folder(root)
    target = files["blue"][1]
    first = cache.decode(_folder_stream(root), 16)
    assert not first.from_cache
    reread = _folder_stream(root)  # unchanged files: the same key, the entry is reused
    old_key = cache.cache_key(reread, 16)
    assert cache.decode(reread, 16).from_cache
    before = os.stat(target)
    time.sleep(0.05)  # a later clock tick for the change time
    _rewrite_same_size(target, 7)
    os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(target)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert after.st_ctime_ns != before.st_ctime_ns
    stream = _folder_stream(root)
    assert cache.cache_key(stream, 16) != old_key
    again = cache.decode(stream, 16)
    assert not again.from_cache  # the old entry is not reused
    rows = [p for name in sorted(files) for p in sorted(files[name])]  # the factory's order
    assert (again.images[rows.index(target)] == 7).all()
    assert np.array_equal(again.images, cache.decode(stream, 16, use_cache=False).images)


def _decode_in_child(root, ready, queue) -> None:
    stream = _folder_stream(root)
    ready.set()
    decoded = cache.decode(stream, 16)
    path = cache.cache_path(stream, 16)
    queue.put((decoded.from_cache, decoded.images.tobytes(), os.stat(path).st_ino))


def test_two_processes_decoding_one_entry_decode_it_once_and_both_read_it(tmp_path, fresh_cache):
    write_folder(tmp_path / "imgs", per_class=3)
    stream = _folder_stream(tmp_path / "imgs")
    path = cache.cache_path(stream, 16)
    path.parent.mkdir(parents=True, exist_ok=True)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    readies = [ctx.Event(), ctx.Event()]
    procs = [
        ctx.Process(target=_decode_in_child, args=(tmp_path / "imgs", r, queue)) for r in readies
    ]
    with FileLock(str(path) + ".lock"):  # both find no entry and wait for the lock
        for p in procs:
            p.start()
        assert all(r.wait(60) for r in readies)
        time.sleep(0.3)
    got = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert sorted(from_cache for from_cache, _, _ in got) == [False, True]  # decoded once
    expected = cache.decode(stream, 16, use_cache=False).images.tobytes()
    assert all(images == expected for _, images, _ in got)
    assert len({inode for _, _, inode in got}) == 1  # one file, written once


@pytest.fixture()
def folder(tmp_path):
    root = tmp_path / "imgs"
    write_folder(root, per_class=3)
    return root


def test_every_cache_policy_gives_the_same_cells(tmp_path, folder, fresh_cache):
    records = {
        policy: run(
            tmp_path / f"{policy}.json", "zeroshot", "tiny-folder", data_dir=str(folder),
            cache=policy,
        )
        for policy in POLICIES
    }  # fmt: skip
    assert records["always"]["loop"]["sources"] == ["decoded"]
    assert records["never"]["loop"]["sources"] == ["streamed"]
    assert records["auto"]["loop"]["sources"] == ["decoded"]  # small: decoded once, reused
    assert scores(records["always"]) == scores(records["never"]) == scores(records["auto"])
    assert records["always"]["cells"][0]["n"] == 12
    oracle = run(tmp_path / "o.json", "colour_oracle", "tiny-folder", data_dir=str(folder))
    assert oracle["cells"][0]["accuracy"] == 1.0  # decoded, resized and labelled right


def test_bad_images_are_skipped_alike_under_every_policy_and_reported(
    tmp_path, folder, fresh_cache, capsys
):
    bad = folder / "green" / "img9.png"  # row 6: blue 0-2, green 3-6
    bad.write_bytes((folder / "green" / "img0.png").read_bytes()[:100])  # truncated
    records, messages = {}, {}
    for policy in POLICIES:
        out = tmp_path / f"{policy}.json"
        rc, _, err = cli(
            capsys, "run", "--method", "colour_oracle", "--suite", "tiny-folder", "--quiet",
            "--data-dir", str(folder), "--output", str(out), "--on-bad-image", "skip",
            f"cache={policy}", "seeds=[0,1]",
        )  # fmt: skip
        assert rc == 0, err
        messages[policy] = [line for line in err.splitlines() if line.startswith("skipped")]
        records[policy] = json.loads(out.read_text())
    for policy, record in records.items():
        assert all(c["n"] == 12 and c["accuracy"] == 1.0 for c in record["cells"]), policy
    assert scores(records["always"]) == scores(records["never"]) == scores(records["auto"])
    reported = {
        policy: [
            (name, b["index"], b["path"]) for name, bs in r["skipped_images"].items() for b in bs
        ]
        for policy, r in records.items()
    }
    assert reported["always"] == [("folder-imgs", 6, str(bad))]
    assert reported["never"] == reported["auto"] == reported["always"], reported
    assert messages["always"][0].startswith(f"skipped 1 unreadable image(s) in folder-imgs: {bad}")
    assert messages["never"] == messages["auto"] == messages["always"], messages


def test_bad_images_fail_the_run_alike_naming_the_file_under_every_policy(
    tmp_path, folder, fresh_cache, capsys
):
    bad = folder / "red" / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    errors = {}
    for policy in POLICIES:
        rc, _, err = cli(
            capsys, "run", "--suite", "tiny-folder", "--quiet", "--data-dir", str(folder),
            "--output", str(tmp_path / f"{policy}.json"), f"cache={policy}",
        )  # fmt: skip
        assert rc == 2, (policy, err)
        assert str(bad) in err and "--on-bad-image=skip" in err, (policy, err)
        errors[policy] = err
    assert errors["always"].startswith("tta-bench: error: domain 'folder-imgs': 1 image(s)")
    # Streamed (decoded in a loader worker), the error must read the same: no worker traceback.
    assert errors["never"] == errors["auto"] == errors["always"], errors["never"]


def test_the_disk_budget_refuses_always_and_auto_streams_instead(
    tmp_path, folder, fresh_cache, monkeypatch, capsys
):
    monkeypatch.setenv(cache.BUDGET_ENV, str(1000 / 2**30))  # 1,000 bytes; 12 images need 9,216
    rc, _, err = cli(
        capsys, "run", "--suite", "tiny-folder", "--quiet", "--data-dir", str(folder),
        "--output", str(tmp_path / "always.json"), "cache=always",
    )  # fmt: skip
    assert rc == 2 and cache.BUDGET_ENV in err and "cache=never" in err
    record = run(tmp_path / "auto.json", "zeroshot", "tiny-folder", data_dir=str(folder))
    assert record["loop"]["sources"] == ["streamed"]
    assert cache.cache_entries() == []  # nothing was written
    monkeypatch.delenv(cache.BUDGET_ENV)
    cached = run(tmp_path / "cached.json", "zeroshot", "tiny-folder", data_dir=str(folder))
    kinds = sorted(e["kind"] for e in cache.cache_entries())
    assert cached["loop"]["sources"] == ["decoded"] and kinds.count("decoded") == 1
    assert scores(cached) == scores(record)


@pytest.mark.parametrize("workers", [0, 1])
def test_auto_decodes_a_small_split_when_the_stream_reaches_it_not_in_setup(
    tmp_path, fresh_cache, workers
):
    """A suite of many small domains waits for its first one only: before the first batch,
    nothing is decoded; reading domain 0's batch decodes domain 0 alone (in the loader's
    worker when there is one), with the pixels an up-front decode gives."""
    from tta_bench.run.loader import LoaderSettings, StreamBatches, make_loader
    from tta_bench.run.stream import Batch

    streams = []
    for name in ("a", "b"):
        write_folder(tmp_path / name, per_class=3)
        streams.append(_folder_stream(tmp_path / name))
    opened = [sources.open_source(s, 16, cache="auto") for s in streams]
    assert [type(s).__name__ for s in opened] == ["CachingSource"] * 2
    assert cache.cache_entries() == []  # setup decoded nothing
    n = len(streams[0])
    batches = [Batch(0, np.arange(n), np.zeros(n, dtype=np.int64), False, 0)]
    labels = [s.labels for s in streams]
    settings = LoaderSettings(workers, False, 2 if workers else None, False)
    loader = make_loader(StreamBatches(batches, opened, [0, 1], labels), settings)
    (item,) = list(loader)
    entries = cache.cache_entries()
    assert len(entries) == 1 and entries[0]["name"] == streams[0].name
    expected = cache.decode(streams[0], 16, use_cache=False).images
    assert np.array_equal(np.asarray(item["images"]), expected)


def _one_class_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "single class" in str(w.message)]


def test_a_one_class_domain_warns_that_its_accuracy_means_nothing(tmp_path, fresh_cache):
    """A classifier over one class is always right: a run over a one-class split scores
    100% whatever the method. Every policy's source warns once, naming the domain (and its
    folder where the dataset records one); two classes or more: no such warning."""
    import shutil

    root = tmp_path / "imgs"
    write_folder(root)
    for name in ("green", "red", "yellow"):
        shutil.rmtree(root / name)
    stream = _folder_stream(root)
    assert stream.classnames == ["blue"]
    for policy in POLICIES:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sources.open_source(stream, 16, cache=policy)
        [message] = _one_class_warnings(caught)
        assert "domain 'folder-imgs'" in message and "'blue'" in message, message
        assert "accuracy" in message and "meaningless" in message, message
    stream.metadata["source"] = str(root)  # what the plugin's folder datasets record
    with pytest.warns(UserWarning, match="single class") as caught:
        record = run(tmp_path / "one.json", "zeroshot", "tiny-folder", data_dir=str(root))
    assert record["cells"][0]["accuracy"] == 1.0  # the score the warning is about
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sources.open_source(stream, 16, cache="never")
    assert str(root) in _one_class_warnings(caught)[0]
    write_folder(tmp_path / "two")
    shutil.rmtree(tmp_path / "two" / "green")
    shutil.rmtree(tmp_path / "two" / "red")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sources.open_source(_folder_stream(tmp_path / "two"), 16, cache="never")
    assert _one_class_warnings(caught) == []


def test_a_streams_labels_follow_its_row_order_and_a_missing_one_is_refused():
    """``DomainStream.labels`` reads the label column whole (Arrow), in the dataset's row
    order after ``select`` and ``shuffle`` (an indices mapping), as the rows read one by
    one give them; a row without a label is refused, not read as a number."""
    import datasets

    from tta_bench.data import DomainStream

    table = datasets.Dataset.from_dict({"image": [None] * 6, "label": [0, 1, 2, 0, 1, 2]})
    for ds in (table, table.select([5, 3, 1, 4]).shuffle(seed=1)):
        stream = DomainStream("d", ["a", "b", "c"], ["{}"], ds, "fp")
        assert stream.labels.dtype == np.int64
        assert stream.labels.tolist() == [row["label"] for row in ds]
    unlabeled = datasets.Dataset.from_dict({"image": [None, None], "label": [0, None]})
    with pytest.raises((TypeError, ValueError)):
        DomainStream("d", ["a"], ["{}"], unlabeled, "fp")
