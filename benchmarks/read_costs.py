"""What reading the shipped metadata, data, weights and the committed per-sample files costs,
with the reader the harness and the plugin use against the one they replaced:

* **catalogue**: parsing the plugin's ``registry.yaml`` (every process that lists, resolves
  or runs anything reads it) with ``tta_bench.catalog.SAFE_LOADER`` (libyaml's safe loader
  where PyYAML has it) against PyYAML's pure-Python ``SafeLoader``;
* **per-sample file**: one committed cell file of ``results/digits-c`` (bytes already in
  memory) read as ``tta_bench.run.samples.open_cell`` reads it, ``pq.ParquetFile(...).read()``
  on one thread, against ``pq.read_table``, averaged over the first ``--files`` files; and
  the five columns a paired comparison reads (``report.paired.read_run``) against the whole
  file read on the thread pool, as ``open_cell`` read it before;
* **domain labels**: the digits test split's labels as ``DomainStream.labels`` reads them
  (one Arrow column) against ``numpy.asarray`` over the dataset's lazy ``Column``;
* **vocabulary hash**: ``text_head._vocab_sha256`` of a new tiny-clip-digits tokenizer (a
  bundle's wrapper around the shared one: its memo) against hashing the vocabulary again;
* **default dataset**: the digits test split's stream (``mura_plugin.datasets.digits``), its
  HF dataset built once per process, against building it at every call (every image
  encoded as PNG);
* **default model**: the ``tiny-clip-digits`` bundle, a deep copy of the model loaded once
  per process, against loading the shipped file into a newly built model at every call;
* **entry-point scan**: the origins of the methods group's entry points, each
  distribution's name and version read once per scan (``registry._origin``'s memo) against
  read at every entry point (each read parses the distribution's metadata file);
* **results file**: a committed ``results/digits-c`` file loaded by ``load_results`` when its
  contents passed validation before in the process, against parsed and validated again;
* **pairing**: every ordered pair of the first ``--runs`` committed ``digits-c`` runs with
  per-sample files (rows already read), paired as ``report.paired.pair_rows`` pairs them (each
  run's correct rows and batch numbers computed once) against computing them again for every
  pair, as it did before.

Each measurement alternates the two readers ``--repeats`` times and prints the median and
range of each and the ratio of the medians. Both readers are first checked to give the same
data (the same dict; tables equal with their schema metadata; the same images and labels;
the same tensors).

Usage::

    python benchmarks/read_costs.py [--repeats 7] [--files 200] [--runs 8]

Run it on an idle machine (``uptime``): the figures are timings. Nothing else is asserted.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import yaml

from mura_plugin.datasets import digits as dg
from mura_plugin.models import tiny_clip
from tta_bench import catalog, text_head
from tta_bench import registry as registry_module
from tta_bench.report import paired
from tta_bench.report.paired import PAIRED_COLUMNS
from tta_bench.run import results, samples, schema

ROOT = Path(__file__).resolve().parents[1]


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _fmt(values: list[float], scale: float, unit: str) -> str:
    v = [x * scale for x in values]
    return f"{statistics.median(v):.2f} {unit} ({min(v):.2f}-{max(v):.2f})"


#: (reader used, reader replaced, per call, scale, unit) by what is read
Pairs = dict[str, tuple[Callable[[], object], Callable[[], object], float, float, str]]


def _file_pairs(text: str, raw: list[bytes]) -> Pairs:
    """The catalogue and the per-sample files, each pair of readers checked to agree."""
    assert yaml.load(text, Loader=catalog.SAFE_LOADER) == yaml.load(text, Loader=yaml.SafeLoader)

    def one_thread(r: bytes) -> pa.Table:  # as samples.open_cell reads a file
        return samples.table_of(r)

    def paired_columns(r: bytes) -> pa.Table:  # as report.paired.read_run reads one
        return samples.table_of(r, PAIRED_COLUMNS)

    for r in raw:
        new, old = one_thread(r), pq.read_table(pa.BufferReader(r))
        assert new.equals(old, check_metadata=True)
        assert paired_columns(r).equals(old.select(paired_columns(r).column_names))
    per = 1.0 / len(raw)
    return {
        "catalogue (registry.yaml)": (
            lambda: yaml.load(text, Loader=catalog.SAFE_LOADER),
            lambda: yaml.load(text, Loader=yaml.SafeLoader),
            1.0, 1e3, "ms",
        ),
        f"per-sample file (mean of {len(raw)})": (
            lambda: [one_thread(r) for r in raw],
            lambda: [pq.read_table(pa.BufferReader(r)) for r in raw],
            per, 1e3, "ms",
        ),
        f"paired columns (mean of {len(raw)})": (
            lambda: [paired_columns(r) for r in raw],
            lambda: [pq.ParquetFile(pa.BufferReader(r)).read() for r in raw],
            per, 1e3, "ms",
        ),
    }  # fmt: skip


def _data_pairs() -> Pairs:
    """The digits stream and its labels, each pair of readers checked to agree."""
    names = tuple(dg.digits(split="test").classnames)
    stream = dg.digits(split="test")
    assert np.array_equal(stream.labels, np.asarray(stream.dataset["label"], dtype=np.int64))

    def digits_each_call():  # what a call built before: the split's dataset, every time
        return dg._dataset.__wrapped__("test", None, names)

    new_ds, old_ds = stream.dataset, digits_each_call()
    assert new_ds["label"] == old_ds["label"]
    assert all(np.array_equal(np.asarray(new_ds[i]["image"]), np.asarray(old_ds[i]["image"]))
               for i in range(0, len(new_ds), 37))  # fmt: skip
    return {
        "domain labels (digits test)": (
            lambda: stream.labels,
            lambda: np.asarray(stream.dataset["label"], dtype=np.int64),
            1.0, 1e3, "ms",
        ),
        "digits test stream": (lambda: dg.digits(split="test"), digits_each_call, 1.0, 1e3, "ms"),
    }  # fmt: skip


def _model_pairs() -> Pairs:
    """The default model and its vocabulary's hash, each pair checked to agree."""
    vocab = tiny_clip.tokenizer().encoder

    def vocab_each_call() -> str:  # what each head key did before: the whole vocabulary
        blob = json.dumps(sorted(vocab.items(), key=lambda kv: str(kv[0])), default=str)
        return hashlib.sha256(blob.encode()).hexdigest()

    def vocab_memo() -> str:
        wrapper = tiny_clip.ShippedTokenizer(set(tiny_clip.trained_token_ids()))
        return text_head._vocab_sha256(wrapper)

    def model_each_call():  # what a call did before: a new model, the file loaded into it
        model, recipe = tiny_clip.load_shipped(tiny_clip.SHIPPED_WEIGHTS)
        tokenizer = tiny_clip.ShippedTokenizer(set(tiny_clip.trained_token_ids()))
        return model, recipe, tokenizer, tiny_clip.file_sha256(tiny_clip.SHIPPED_WEIGHTS)

    assert vocab_memo() == vocab_each_call()
    new_sd = tiny_clip.tiny_clip_digits().clip.state_dict()
    old_sd = model_each_call()[0].state_dict()
    assert all(torch.equal(new_sd[k], v) for k, v in old_sd.items())
    return {
        "vocabulary hash (tiny-clip)": (vocab_memo, vocab_each_call, 1.0, 1e3, "ms"),
        "default model (tiny-clip-digits)": (
            tiny_clip.tiny_clip_digits, model_each_call, 1.0, 1e3, "ms",
        ),
    }  # fmt: skip


def _harness_pairs(runs: int) -> Pairs:
    """The entry-point scan, a results file's load and the pairing of runs, each pair of
    ways checked to agree."""
    group = "tta_bench.methods"

    def origins(share: bool) -> list[registry_module.Origin]:
        seen: dict[int, tuple[str, str]] = {}
        eps = registry_module._entry_points(group)
        return [registry_module._origin(group, ep, seen if share else {}) for ep in eps]

    assert origins(True) == origins(False)
    path = ROOT / "results" / "digits-c" / "tent.json"

    def validated_again() -> dict:
        data = json.loads(path.read_text(encoding="utf-8"))
        schema.validate(data, str(path))
        return data

    assert results.load_results(path) == validated_again()
    found = sorted(p for p in (ROOT / "results" / "digits-c").glob("*.json")
                   if samples.samples_dir(p).is_dir())[:runs]  # fmt: skip
    read = [
        (rec, paired.read_run(rec, p)) for rec, p in zip(map(results.load_results, found), found)
    ]

    def fresh(rows: dict) -> dict:  # new CellRows: their memos empty, as after read_run
        return {k: paired.CellRows(v.index, v.batch, v.label, v.prediction, v.reference)
                for k, v in rows.items()}  # fmt: skip

    def pairs_now() -> list:
        cold = [(rec, fresh(rows)) for rec, rows in read]
        return [paired.pair_rows(a, ar, b, br) for a, ar in cold for b, br in cold if a is not b]

    def pairs_before() -> list:  # each pair computed A's correct rows and batches again
        out = []
        for a, ar in read:
            for b, br in read:
                if a is b:
                    continue
                keys = [k for k in ar if k in br]
                a_ok, b_ok, blocks, offset = [], [], [], 0
                for key in keys:
                    x, y = ar[key], br[key]
                    assert np.array_equal(x.index, y.index)  # the committed runs: one order
                    oa = ob = np.arange(len(x.index))
                    for what in ("label", "batch"):
                        assert not np.flatnonzero(getattr(x, what)[oa] != getattr(y, what)[ob]).size
                    label = x.label[oa]
                    known = label >= 0
                    a_ok.append((x.prediction[oa] == label)[known])
                    b_ok.append((y.prediction[ob] == label)[known])
                    _, ids = np.unique(x.batch[oa][known], return_inverse=True)
                    blocks.append(ids.reshape(-1) + offset)
                    offset += int(ids.max()) + 1 if len(ids) else 0
                out.append((np.concatenate(a_ok), np.concatenate(b_ok), np.concatenate(blocks)))
        return out

    for new, old in zip(pairs_now(), pairs_before()):
        assert all(
            np.array_equal(n, o) for n, o in zip((new.a_correct, new.b_correct, new.block), old)
        )
    n = len(read) * (len(read) - 1)
    return {
        "entry-point scan (methods)": (
            lambda: origins(True), lambda: origins(False), 1.0, 1e3, "ms",
        ),
        "results file (tent, digits-c)": (
            lambda: results.load_results(path), validated_again, 1.0, 1e3, "ms",
        ),
        f"pairing ({n} pairs of {len(read)} runs)": (pairs_now, pairs_before, 1.0, 1e3, "ms"),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--files", type=int, default=200)
    parser.add_argument("--runs", type=int, default=8, help="runs paired in the pairing row")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.files < 1 or args.runs < 2:
        parser.error(
            f"--repeats and --files must be >= 1 and --runs >= 2, got {args.repeats}, "
            f"{args.files}, {args.runs}"
        )
    text = (ROOT / "registry.yaml").read_text(encoding="utf-8")
    files = sorted((ROOT / "results" / "digits-c").glob("*.samples/*.parquet"))[: args.files]
    if not files:
        parser.error(f"no per-sample files under {ROOT / 'results' / 'digits-c'}")
    raw = [f.read_bytes() for f in files]
    pairs = {
        **_file_pairs(text, raw),
        **_data_pairs(),
        **_model_pairs(),
        **_harness_pairs(args.runs),
    }
    print(f"{'what':32s} {'used: median (range)':26s} {'replaced':26s} ratio")
    for name, (used, replaced, per, scale, unit) in pairs.items():
        used(), replaced()  # warm-up
        a, b = [], []
        for _ in range(args.repeats):
            a.append(_seconds(used) * per)
            b.append(_seconds(replaced) * per)
        ratio = statistics.median(b) / statistics.median(a)
        print(f"{name:32s} {_fmt(a, scale, unit):26s} {_fmt(b, scale, unit):26s} {ratio:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
