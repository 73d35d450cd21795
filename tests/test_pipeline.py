"""The data pipeline: DataLoader settings, worker-count independence, and ``profile``."""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
from method_runs import digits_c_spec

from tta_bench.run import profiler as profile
from tta_bench.run import runner
from tta_bench.run.loader import StreamBatches, make_loader, resolve_settings
from tta_bench.run.protocol import load_protocol
from tta_bench.run.spec import RunSpec
from tta_bench.run.stream import build_stream


def _spec(loader=None, method: str = "tent", reset: str = "reset_each_shift") -> RunSpec:
    protocol = {
        "reset": reset,
        "shifts": ["gaussian_noise", "contrast"],
        "max_images": 64,
        "batch_size": 16,
    }
    return digits_c_spec(method, [0, 1], protocol, resume=False, loader=loader)


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
    from tta_bench.run.sources import ArraySource

    images = np.lib.format.open_memmap(
        tmp_path / "x.npy", mode="w+", dtype=np.uint8, shape=(len(digits_stream), 4, 4, 3)
    )
    images[:] = np.arange(len(digits_stream), dtype=np.uint8)[:, None, None, None]
    images.flush()
    mm = np.load(tmp_path / "x.npy", mmap_mode="r")
    p = load_protocol("digits-c", reset="mixed_domains", shifts=["contrast"], max_images=40)
    labels = {d: digits_stream.labels for d in [("contrast", 5)]}
    stream = build_stream(p, 0, labels)
    ds = StreamBatches(stream.batches, [ArraySource("x", mm)], [0], [digits_stream.labels])
    clone = pickle.loads(pickle.dumps(ds))
    assert isinstance(clone.sources[0].images, np.memmap)  # re-mapped, not copied
    assert len(pickle.dumps(ds)) < mm.nbytes
    loader = make_loader(ds, resolve_settings({"num_workers": 2}, torch.device("cpu")))
    got = list(loader)
    assert [g["number"] for g in got] == [b.number for b in stream.batches]
    for g, b in zip(got, stream.batches):
        assert g["images"][:, 0, 0, 0].tolist() == (b.indices % 256).tolist()
        assert g["labels"].tolist() == digits_stream.labels[b.indices].tolist()


def protocol_classnames() -> list[str]:
    from tta_bench.catalog import entry

    return list(entry("datasets", "digits")["classnames"])


@pytest.mark.parametrize("reset", ["reset_each_shift", "mixed_domains"])
def test_results_are_identical_whichever_cache_policy(tmp_path, tmp_cache, reset):
    """cache=always (decode the split into the cache first), never (decode on demand in
    the loader) and auto give the same cells, bad images skipped alike."""
    from PIL import Image

    from mura_plugin.datasets.digits import digits_arrays

    x, y = digits_arrays("test")
    root = tmp_path / "digits"
    for i in range(48):  # a real image folder at another size: decoding resizes it
        folder = root / str(int(y[i]))
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(x[i]).resize((40, 40)).save(folder / f"{i:03d}.png")
    bad = root / str(int(y[7])) / "007.png"
    bad.write_bytes(bad.read_bytes()[:60])
    protocol = load_protocol(
        "digits-c",
        reset=reset,
        shifts=["gaussian_noise", "contrast"],
        batch_size=16,
    )
    protocol = dataclasses.replace(
        protocol,
        dataset="imagefolder",
        dataset_args={"data_dir": str(root), "classnames": list(protocol_classnames())},
    )
    out = {}
    for policy in ("always", "never", "auto"):
        spec = dataclasses.replace(
            _spec(method="tent", reset=reset),
            protocol=protocol,
            seeds=[0],
            cache=policy,
            on_bad_image="skip",
        )
        record = runner.run(spec, tmp_path / f"{policy}.json")
        assert record["skipped_images"], policy
        out[policy] = [(c["shift"], c["n"], c["accuracy"], c["nll"]) for c in record["cells"]]
        assert record["loop"]["sources"] == ["streamed" if policy == "never" else "decoded"]
    assert out["always"] == out["never"] == out["auto"]
    assert all(n == 47 for _, n, _, _ in out["always"])  # one unreadable image left out


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


@pytest.mark.slow
def test_profile_command(default_bundle, capsys):
    from tta_bench.cli import main

    args = ["profile", "--batches", "2", "protocol.shifts=[contrast]"]
    assert main([*args, "protocol.max_images=32", "protocol.batch_size=16"]) == 0
    printed = capsys.readouterr().out
    for text in ("data wait", "shift", "model", "data-wait share", "recommendation:"):
        assert text in printed


@pytest.mark.parametrize("high_water_mark", [True, False], ids=["vmhwm", "sampler"])
def test_peak_memory_sees_a_transient_allocation(high_water_mark):
    """A 200 MB buffer allocated and freed inside the context shows up in the CPU peak,
    through the kernel's high-water mark and through the sampling fallback. In a fresh
    process: what a long test session's heap already holds resident can absorb the
    buffer without any RSS growth (seen in the full suite)."""
    code = f"""
import time
import numpy as np
import torch
from tta_bench.run import cost
if not {high_water_mark!r}:
    cost._reset_high_water_mark = lambda: False
with cost.PeakMemory(torch.device("cpu"), interval_s=0.01) as mem:
    buf = np.ones(25_000_000)  # 200 MB, touched
    if not {high_water_mark!r}:
        time.sleep(0.1)  # the sampler needs to see it
    del buf
print(mem.kind, mem.peak_bytes)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    kind, peak = done.stdout.split()
    assert kind == "cpu_rss_growth"
    assert 150e6 < int(peak) < 400e6, peak


@pytest.mark.parametrize("mode", ["RGB", "L"])
def test_jpeg_fast_decoder_gives_pils_pixels(tmp_path, mode):
    """decode_one reads JPEGs with torchvision's decode_jpeg: the same pixels as PIL (both
    libjpeg-turbo), at the model size and resized; a truncated file is still an error."""
    import io

    from PIL import Image

    from tta_bench.run.cache import _decode_jpeg, _open_raw, decode_one, to_rgb_array

    rng = np.random.default_rng(0)
    for w, h in ((224, 224), (300, 200), (57, 91)):
        arr = (rng.random((h, w, 3)) * 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(arr).convert(mode).save(buf, format="JPEG", quality=90)
        data = buf.getvalue()
        assert _decode_jpeg(data) is not None  # the fast path is taken
        pil_img, _ = _open_raw({"bytes": data, "path": None})
        for size in (32, 224):
            expected = to_rgb_array(pil_img, size)
            got = decode_one({"bytes": data, "path": None}, size)
            assert np.array_equal(got, expected), (w, h, size)
        path = tmp_path / f"{w}x{h}.jpg"
        path.write_bytes(data[: len(data) // 2])
        with pytest.raises(OSError):
            decode_one({"bytes": None, "path": str(path)}, 32)
