"""What reading the shipped metadata, data, weights and the committed per-sample files costs,
with the reader the harness and the plugin use against the one they replaced:

* **catalogue**: parsing the plugin's ``registry.yaml`` (every process that lists, resolves
  or runs anything reads it) with ``tta_bench.catalog.SAFE_LOADER`` (libyaml's safe loader
  where PyYAML has it) against PyYAML's pure-Python ``SafeLoader``;
* **per-sample file**: one committed cell file of ``results/digits-c`` (bytes already in
  memory) read as ``tta_bench.run.samples.open_cell`` reads it, ``pq.ParquetFile(...).read()``,
  against ``pq.read_table``, averaged over the first ``--files`` files;
* **default dataset**: the digits test split's stream (``mura_plugin.datasets.digits``), its
  HF dataset built once per process, against building it at every call (every image
  encoded as PNG);
* **default model**: the ``tiny-clip-digits`` bundle, a deep copy of the model loaded once
  per process, against loading the shipped file into a newly built model at every call.

Each measurement alternates the two readers ``--repeats`` times and prints the median and
range of each and the ratio of the medians. Both readers are first checked to give the same
data (the same dict; tables equal with their schema metadata; the same images and labels;
the same tensors).

Usage::

    python benchmarks/read_costs.py [--repeats 7] [--files 200]

Run it on an idle machine (``uptime``): the figures are timings. Nothing else is asserted.
"""

from __future__ import annotations

import argparse
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
from tta_bench import catalog

ROOT = Path(__file__).resolve().parents[1]


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _fmt(values: list[float], scale: float, unit: str) -> str:
    v = [x * scale for x in values]
    return f"{statistics.median(v):.2f} {unit} ({min(v):.2f}-{max(v):.2f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--files", type=int, default=200)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.files < 1:
        parser.error(f"--repeats and --files must be >= 1, got {args.repeats}, {args.files}")

    text = (ROOT / "registry.yaml").read_text(encoding="utf-8")
    files = sorted((ROOT / "results" / "digits-c").glob("*.samples/*.parquet"))[: args.files]
    if not files:
        parser.error(f"no per-sample files under {ROOT / 'results' / 'digits-c'}")
    raw = [f.read_bytes() for f in files]
    assert yaml.load(text, Loader=catalog.SAFE_LOADER) == yaml.load(text, Loader=yaml.SafeLoader)
    for r in raw:
        new, old = pq.ParquetFile(pa.BufferReader(r)).read(), pq.read_table(pa.BufferReader(r))
        assert new.equals(old, check_metadata=True)

    names = tuple(dg.digits(split="test").classnames)

    def digits_each_call():  # what a call built before: the split's dataset, every time
        return dg._dataset.__wrapped__("test", None, names)

    def model_each_call():  # what a call did before: a new model, the file loaded into it
        model, recipe = tiny_clip.load_shipped(tiny_clip.SHIPPED_WEIGHTS)
        tokenizer = tiny_clip.ShippedTokenizer(set(tiny_clip.trained_token_ids()))
        return model, recipe, tokenizer, tiny_clip.file_sha256(tiny_clip.SHIPPED_WEIGHTS)

    new_ds, old_ds = dg.digits(split="test").dataset, digits_each_call()
    assert new_ds["label"] == old_ds["label"]
    assert all(np.array_equal(np.asarray(new_ds[i]["image"]), np.asarray(old_ds[i]["image"]))
               for i in range(0, len(new_ds), 37))  # fmt: skip
    new_sd = tiny_clip.tiny_clip_digits().clip.state_dict()
    old_sd = model_each_call()[0].state_dict()
    assert all(torch.equal(new_sd[k], v) for k, v in old_sd.items())

    pairs = {
        "catalogue (registry.yaml)": (
            lambda: yaml.load(text, Loader=catalog.SAFE_LOADER),
            lambda: yaml.load(text, Loader=yaml.SafeLoader),
            1.0,
            1e3,
            "ms",
        ),
        f"per-sample file (mean of {len(raw)})": (
            lambda: [pq.ParquetFile(pa.BufferReader(r)).read() for r in raw],
            lambda: [pq.read_table(pa.BufferReader(r)) for r in raw],
            1.0 / len(raw),
            1e3,
            "ms",
        ),
        "digits test stream": (
            lambda: dg.digits(split="test"),
            digits_each_call,
            1.0,
            1e3,
            "ms",
        ),
        "default model (tiny-clip-digits)": (
            tiny_clip.tiny_clip_digits,
            model_each_call,
            1.0,
            1e3,
            "ms",
        ),
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
