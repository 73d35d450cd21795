"""The data pipeline: DataLoader settings, worker-count independence, and ``profile``."""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch

from tta_bench import profile, runner
from tta_bench.loader import StreamBatches, make_loader, resolve_settings
from tta_bench.protocol import load_protocol
from tta_bench.registry import registry
from tta_bench.stream import build_stream


def _spec(loader=None, method: str = "tent", reset: str = "reset_each_shift") -> runner.RunSpec:
    return runner.RunSpec(
        method=method,
        method_config=registry("methods").get(method).Config(),
        model="tiny-clip-digits",
        model_args={},
        protocol=load_protocol(
            "digits-c",
            reset=reset,
            shifts=["gaussian_noise", "contrast"],
            max_images=64,
            batch_size=16,
        ),
        seeds=[0, 1],
        progress=False,
        reference=False,
        resume=False,
        loader=loader,
    )


def test_defaults_follow_the_device_and_bad_settings_fail():
    cpu = resolve_settings(None, torch.device("cpu"))
    assert (cpu.num_workers, cpu.pin_memory, cpu.prefetch_factor) == (0, False, None)
    cuda = resolve_settings({}, torch.device("cuda"))
    assert cuda.num_workers >= 1 and cuda.pin_memory and cuda.prefetch_factor == 2
    assert not resolve_settings({"pin_memory": True}, torch.device("cpu")).pin_memory
    with pytest.raises(ValueError, match="num_workers must be >= 0, got -1"):
        resolve_settings({"num_workers": -1}, torch.device("cpu"))
    with pytest.raises(ValueError, match="prefetch_factor=4 needs loader.num_workers > 0"):
        resolve_settings({"prefetch_factor": 4}, torch.device("cpu"))


@pytest.mark.parametrize("reset", ["reset_each_shift", "mixed_domains"])
def test_same_results_with_0_and_2_workers(tmp_path, default_bundle, reset):
    a = runner.run(_spec({"num_workers": 0}, reset=reset), tmp_path / "w0.json")
    b = runner.run(
        _spec({"num_workers": 2, "prefetch_factor": 2}, reset=reset), tmp_path / "w2.json"
    )
    assert a["loop"]["loader"]["num_workers"] == 0 and b["loop"]["loader"]["num_workers"] == 2
    keys = ("shift", "severity", "seed", "n", "accuracy", "nll", "ece")
    rows_a = [tuple(c.get(k) for k in keys) for c in a["cells"]]
    rows_b = [tuple(c.get(k) for k in keys) for c in b["cells"]]
    assert rows_a == rows_b and len(rows_a) == 4


def test_loader_yields_the_stream_in_order_and_memmaps_travel_as_paths(tmp_path, digits_stream):
    images = np.lib.format.open_memmap(
        tmp_path / "x.npy", mode="w+", dtype=np.uint8, shape=(len(digits_stream), 4, 4, 3)
    )
    images[:] = np.arange(len(digits_stream), dtype=np.uint8)[:, None, None, None]
    images.flush()
    mm = np.load(tmp_path / "x.npy", mmap_mode="r")
    p = load_protocol("digits-c", reset="mixed_domains", shifts=["contrast"], max_images=40)
    labels = {d: digits_stream.labels for d in [("contrast", 5)]}
    stream = build_stream(p, 0, labels)
    ds = StreamBatches(stream.batches, [mm], [0], [digits_stream.labels])
    clone = pickle.loads(pickle.dumps(ds))
    assert isinstance(clone.arrays[0], np.memmap)  # re-mapped, not copied
    assert len(pickle.dumps(ds)) < mm.nbytes
    loader = make_loader(ds, resolve_settings({"num_workers": 2}, torch.device("cpu")))
    got = list(loader)
    assert [g["number"] for g in got] == [b.number for b in stream.batches]
    for g, b in zip(got, stream.batches):
        assert g["images"][:, 0, 0, 0].tolist() == (b.indices % 256).tolist()
        assert g["labels"].tolist() == digits_stream.labels[b.indices].tolist()


def test_profile_reports_the_split_and_a_recommendation(default_bundle):
    prof = profile.profile(_spec(method="zeroshot"), batches=3)
    assert prof.batches == 3 and prof.images == 48
    assert prof.model_s > 0 and prof.shift_s > 0 and prof.data_wait_s > 0
    assert 0.0 < prof.data_wait_share < 1.0
    assert "data wait" in prof.table() and prof.recommendation()
    starved = profile.Profile(3, 48, 0.0, 3.0, 0.1, 1.0, 0.0, "cuda", {"num_workers": 0})
    assert "raise loader.num_workers" in starved.recommendation()
    fed = profile.Profile(3, 48, 0.0, 0.01, 0.1, 1.0, 0.0, "cuda", {"num_workers": 4})
    assert "nothing to change" in fed.recommendation()


def test_profile_command(default_bundle):
    cmd = [sys.executable, "-m", "tta_bench.cli", "profile", "--batches", "2"]
    cmd += ["protocol.shifts=[contrast]", "protocol.max_images=32", "protocol.batch_size=16"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    for text in ("data wait", "shift", "model", "data-wait share", "recommendation:"):
        assert text in done.stdout


@pytest.mark.parametrize("high_water_mark", [True, False], ids=["vmhwm", "sampler"])
def test_peak_memory_sees_a_transient_allocation(monkeypatch, high_water_mark):
    """A 200 MB buffer allocated and freed inside the context shows up in the CPU peak,
    through the kernel's high-water mark and through the sampling fallback."""
    from tta_bench import cost

    if not high_water_mark:
        monkeypatch.setattr(cost, "_reset_high_water_mark", lambda: False)
    with cost.PeakMemory(torch.device("cpu"), interval_s=0.01) as mem:
        buf = np.ones(25_000_000)  # 200 MB, touched
        if not high_water_mark:
            import time

            time.sleep(0.1)  # the sampler needs to see it
        del buf
    assert mem.kind == "cpu_rss_growth"
    assert 150e6 < mem.peak_bytes < 400e6, mem.peak_bytes


def test_peak_memory_is_right_when_the_heap_keeps_freed_blocks():
    """Under ``tta_bench.malloc``'s keep policy (glibc keeps freed big blocks resident for
    reuse; ``TTA_BENCH_MALLOC=keep``) a second context still sees its own transient buffer:
    the retained pages are handed back before its baseline is read. Run in a fresh
    process, so the policy does not leak into the other tests."""
    code = """
import torch
from tta_bench import cost, malloc
if not malloc.keep_freed_memory():
    print("skip")
    raise SystemExit
peaks = []
for n in (20_000_000, 20_000_000, 5_000_000):
    with cost.PeakMemory(torch.device("cpu")) as mem:
        buf = torch.ones(n)  # 80, 80, 20 MB, touched, freed inside the context
        del buf
    peaks.append(mem.peak_bytes)
print(" ".join(str(p) for p in peaks), malloc.policy())
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    if done.stdout.strip() == "skip":
        pytest.skip("not glibc: the allocator policy does not apply")
    *peaks, policy = done.stdout.split()
    assert policy == "keep"
    for peak, size in zip(map(int, peaks), (80e6, 80e6, 20e6)):
        assert 0.9 * size < peak < 1.5 * size, peaks


def test_malloc_policy_from_env(monkeypatch):
    from tta_bench import malloc

    monkeypatch.setitem(malloc._state, "tuned", False)
    monkeypatch.setenv(malloc.ENV, "bogus")
    with pytest.raises(ValueError, match="TTA_BENCH_MALLOC='bogus'.*'system'.*'keep'"):
        malloc.from_env()
    monkeypatch.setenv(malloc.ENV, "system")
    assert malloc.from_env() is False and malloc.policy() == "system"


@pytest.mark.parametrize("reset", ["reset_each_shift", "continual", "mixed_domains"])
def test_chunked_corruption_feeds_the_same_batches(tmp_path, monkeypatch, default_bundle, reset):
    """Consecutive batches of one cell are corrupted in one kernel call (``_chunk``); the
    method still gets, batch by batch, exactly the tensors of one call per batch, and the
    cells come out the same (jpeg through its uint8 entry, glass blur and noise drawing
    per-sample randomness)."""

    def run(chunk_pixels: int) -> tuple[list, list]:
        monkeypatch.setattr(runner, "CHUNK_PIXELS", chunk_pixels)
        seen: list = []
        spec = dataclasses.replace(
            _spec(method="zeroshot", reset=reset),
            protocol=load_protocol(
                "digits-c",
                reset=reset,
                shifts=["gaussian_noise", "jpeg_compression", "glass_blur"],
                max_images=80,
                batch_size=16,
            ),
        )
        ev = runner.Evaluation(
            spec,
            tmp_path / f"{chunk_pixels}.json",
            bundle=default_bundle,
            observer=lambda s, b, x: seen.append((s, b.number, x.clone())),
        )
        return seen, ev.run()["cells"]

    one_by_one, cells_a = run(0)
    chunked, cells_b = run(1 << 20)
    assert [(s, n) for s, n, _ in one_by_one] == [(s, n) for s, n, _ in chunked]
    for (_, n, a), (_, _, b) in zip(one_by_one, chunked):
        assert torch.equal(a, b), n
    keep = ("shift", "severity", "seed", "n", "accuracy", "ece", "nll")
    assert [{k: c[k] for k in keep} for c in cells_a] == [{k: c[k] for k in keep} for c in cells_b]
