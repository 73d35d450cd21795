"""The shifted-image cache (``tta_bench.run.shifted``): a method receives the same corrupted
tensors, bit for bit, with the cache off, building it and reading it; entries are keyed by
what their values depend on, and a damaged entry is built again."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from tta_bench.run import cache as decoded
from tta_bench.run import runner, shifted

from .helpers import cli, spec


def _stream(tmp_path, name: str, **fields) -> tuple[list, dict]:
    """The (seed, indices, sha1 of the images) of every batch a run's method received, and
    the run's record."""
    seen: list = []

    def observer(seed, batch, images):
        digest = hashlib.sha1(images.detach().cpu().numpy().tobytes()).hexdigest()
        seen.append((seed, batch.indices.tolist(), str(images.dtype), digest))

    record = runner.Evaluation(spec(**fields), tmp_path / f"{name}.json", observer=observer).run()
    return seen, record


def _scores(record: dict) -> list:
    return sorted((c["shift"], c["severity"], c["seed"], c["accuracy"]) for c in record["cells"])


@pytest.mark.parametrize(
    "protocol",
    [
        {},  # one domain per batch: gathered from one entry
        {"reset": "mixed_domains"},  # batches mix domains: gathered domain by domain
        {"shifts": ["noise>dim", "noise"], "severities": [2, 4]},  # a composite shift
    ],
    ids=["episodic", "mixed", "composite"],
)
def test_same_tensors_off_cold_and_warm(protocol, tmp_path, fresh_cache):
    kwargs = {"method": "norm_tent", "seeds": (0, 1), "protocol": protocol}
    off, rec_off = _stream(tmp_path, "off", shift_cache="never", **kwargs)
    assert not (fresh_cache / "shifted").exists()  # cache=never writes nothing
    cold, rec_cold = _stream(tmp_path, "cold", **kwargs)
    warm, rec_warm = _stream(tmp_path, "warm", **kwargs)
    assert off == cold == warm
    assert _scores(rec_off) == _scores(rec_cold) == _scores(rec_warm)
    n_domains = len({(c["shift"], c["severity"], c["seed"]) for c in rec_cold["cells"]})
    assert rec_off["loop"]["shift_cache"] == {"policy": "off", "hits": 0, "built": 0}
    assert rec_cold["loop"]["shift_cache"]["built"] == n_domains
    assert rec_warm["loop"]["shift_cache"]["built"] == 0
    assert rec_warm["loop"]["shift_cache"]["hits"] >= rec_warm["loop"]["batches"]
    entries = [e for e in decoded.cache_entries() if e["kind"] == "shifted"]
    assert len(entries) == n_domains  # listed (tta-bench cache ls) and counted in the budget
    assert all(" | seed " in e["name"] for e in entries)


def test_entry_follows_kernel_code_seed_and_severity(tmp_path, fresh_cache, monkeypatch):
    _, first = _stream(tmp_path, "a")
    assert first["loop"]["shift_cache"]["built"] > 0
    _, again = _stream(tmp_path, "b")
    assert again["loop"]["shift_cache"]["built"] == 0
    # Another seed is another noise draw: its own entries.
    _, other_seed = _stream(tmp_path, "c", seeds=(3,))
    assert other_seed["loop"]["shift_cache"]["built"] == first["loop"]["shift_cache"]["built"]
    # Changed kernel code (a new hash of its package's files): built again.
    monkeypatch.setattr(shifted, "_CODE_HASHES", {"tta_bench_testplugin": "changed"})
    monkeypatch.setattr(shifted, "code_hash", lambda m: "changed-" + m)
    _, edited = _stream(tmp_path, "d")
    assert edited["loop"]["shift_cache"]["built"] == first["loop"]["shift_cache"]["built"]


def test_cache_command_lists_and_clears_shifted_entries(tmp_path, fresh_cache, capsys):
    _stream(tmp_path, "a")
    rc, out, _ = cli(capsys, "cache", "list", "--kind", "decoded")
    assert rc == 0 and "shifted" in out and "| seed 0" in out
    rc, out, _ = cli(capsys, "cache", "clear", "--kind", "decoded")
    assert rc == 0 and not list((fresh_cache / "shifted").glob("*.npy"))


def test_damaged_entry_is_built_again(tmp_path, fresh_cache):
    reference, _ = _stream(tmp_path, "a")
    for npy in (fresh_cache / "shifted").glob("*.npy"):
        npy.write_bytes(npy.read_bytes()[:200])  # truncated: not a whole entry
    again, record = _stream(tmp_path, "b")
    assert again == reference
    assert record["loop"]["shift_cache"]["built"] > 0


def test_auto_respects_the_budget(tmp_path, fresh_cache, monkeypatch):
    monkeypatch.setenv("TTA_BENCH_CACHE_BUDGET_GB", "0")
    reference, record = _stream(tmp_path, "a", shift_cache="never")
    got, record = _stream(tmp_path, "b")
    assert got == reference
    assert record["loop"]["shift_cache"]["built"] == 0  # nothing fits: corrupted in the loop
    assert not list((fresh_cache / "shifted").glob("*.npy"))


def test_code_hash_covers_the_kernel_package():
    from tta_bench_testplugin import shifts

    code = shifted.kernel_code(shifts.noise)
    assert "tta_bench_testplugin.shifts=" in code and "tta_bench.run.composite=" in code
    assert shifted.code_hash("tta_bench_testplugin.shifts") == shifted.code_hash(
        "tta_bench_testplugin.shifts"
    )


def test_rows_outside_an_entry_fall_back(tmp_path, fresh_cache):
    """A batch asking for a row the entry does not hold is corrupted in the loop."""
    cache = shifted.ShiftedCache("auto", torch.device("cpu"))
    rows = np.array([1, 4, 9], dtype=np.int64)
    cache._entries[(0, 0)] = (rows, np.zeros((3, 3, 2, 2), np.float32))
    assert cache.take(None, None, 0, np.array([4, 1]), 0).shape == (2, 3, 2, 2)
    assert cache.take(None, None, 0, np.array([4, 5]), 0) is None
    assert cache.take(None, None, 0, np.array([10]), 0) is None
