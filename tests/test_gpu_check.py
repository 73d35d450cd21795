"""benchmarks/gpu_check.py: its logic on the CPU (``--device cpu --quick --tiny``), and the
real check on CUDA where there is one (``@pytest.mark.cuda``)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from processes import collections_of_new_objects_only

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("gpu_check", None)


@pytest.mark.slow
def test_cpu_smoke_runs_every_check_and_every_method(gpu_check, tmp_path, capsys):
    from tta_bench.registry import registry

    out = tmp_path / "report.json"
    shifts = "gaussian_noise,shot_noise,jpeg_compression,snow,zoom_blur"
    # it collects after every method: the modules it imports are imported first, so that
    # those collections skip their objects as they skip the rest of the worker's heap
    import datasets  # noqa: F401
    import open_clip  # noqa: F401

    for kind in ("methods", "shifts", "models", "datasets"):
        for name in registry(kind).names():
            registry(kind).get(name)
    with collections_of_new_objects_only():
        code = gpu_check.main(
            ["--device", "cpu", "--quick", "--tiny", "--shifts", shifts, "--out", str(out)]
        )
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert code == 0, json.dumps(report["checks"], indent=1)[:4000]
    assert report["status"] == "pass" and "overall: pass" in printed
    assert report["env"]["device"] == "cpu" and report["env"]["torch"] == torch.__version__
    assert set(report["checks"]) == {"shifts", "text_head", "methods", "golden"}
    assert report["checks"]["golden"]["status"] == "skip"  # no --data-dir: skipped, not failed

    per_shift = report["checks"]["shifts"]["per_shift"]
    assert list(per_shift) == shifts.split(",")
    assert per_shift["snow"]["kind"] == "thresholded" and per_shift["zoom_blur"]["kind"] == "float"
    tables = report["checks"]["shifts"]["tables"]
    assert {"cifar", "digits", "imagenet"} <= set(tables)
    # the same device on both sides: bit-identical, every table that applies was run
    for name, s in per_shift.items():
        assert s["status"] == "pass" and s["max_abs"] == 0.0, name
    uint8_cases = [c for c in per_shift["jpeg_compression"]["detail"] if c["input"] == "uint8"]
    assert uint8_cases  # the kernel's from_uint8 entry is checked too

    head = report["checks"]["text_head"]
    assert head["cached_equals_built"] and not head["first_build_was_cached"]
    assert head["prompts"] == 16 * 2 and head["cpu_max_abs_diff"] == 0.0

    per_method = report["checks"]["methods"]["per_method"]
    assert set(per_method) == set(registry("methods").names())
    assert list(per_method)[0] == "zeroshot"
    for name, r in per_method.items():
        assert r["status"] == "pass", (name, r.get("error"))
        assert r["images"] == 4 and r["batches"] == 2
        assert r["images_per_s"] > 0 and r["images_per_s_after_first_batch"] > 0
        assert 0.0 <= r["data_wait_share"] <= 1.0
        assert r["peak_memory_kind"] == "cpu_rss_growth"


def _uses_global_rng(images, severity, *, generator, table="cifar"):
    """A kernel that ignores its generator: its output differs from call to call, as a
    kernel drawing on the device (or from the global RNG) would differ between devices."""
    del generator, table
    return images + 0.01 * severity * torch.rand(images.shape, device=images.device)


def _honest(images, severity, *, generator, table="cifar"):
    del table
    return images + 0.01 * severity * generator.normal(*images.shape[1:]).to(images.device)


def test_shift_check_flags_a_kernel_that_differs_between_runs(gpu_check):
    settings = gpu_check.TINY_QUICK
    kernels = {"honest": _honest, "global_rng": _uses_global_rng}
    result = gpu_check.check_shifts(torch.device("cpu"), settings, kernels=kernels)
    assert result["per_shift"]["honest"]["status"] == "pass"
    bad = result["per_shift"]["global_rng"]
    assert bad["status"] == "fail" and bad["max_abs"] > gpu_check.FLOAT_TOL
    assert result["status"] == "fail"
    assert gpu_check.overall_status({"shifts": result}) == "fail"


def test_unsupported_table_is_not_applicable_not_a_failure(gpu_check):
    def imagenet_only(images, severity, *, generator, table="cifar"):
        if table != "imagenet":
            raise ValueError(f"shift 'x' has no severity table {table!r}; available: imagenet")
        return images

    result = gpu_check.check_shifts(
        torch.device("cpu"),
        gpu_check.TINY_QUICK,
        kernels={"x": imagenet_only},
        tables=["cifar", "imagenet"],
    )
    cases = result["per_shift"]["x"]["detail"]
    assert [c["status"] for c in cases] == ["n/a", "pass"]
    assert result["status"] == "pass"


def test_tolerances_by_kernel_kind(gpu_check):
    ref = torch.rand(4, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    one_flip = ref.clone()
    one_flip.view(-1)[123] += 1 / 255  # a single 8-bit level: a thresholded kernel's flip
    many = ref + 2e-3 * (torch.rand(ref.shape) < 0.05)  # 5% of the values off
    rounding = ref + 1e-6
    assert gpu_check.verdict("float", gpu_check.compare(ref, rounding))
    assert not gpu_check.verdict("float", gpu_check.compare(ref, one_flip))
    assert gpu_check.verdict("thresholded", gpu_check.compare(ref, one_flip))
    assert not gpu_check.verdict("thresholded", gpu_check.compare(ref, many))
    nan = ref.clone()
    nan.view(-1)[0] = float("nan")
    assert not gpu_check.verdict("thresholded", gpu_check.compare(ref, nan))


def test_spent_budget_skips_methods_and_fails(gpu_check, tmp_path):
    out = tmp_path / "r.json"
    argv = [
        "--device",
        "cpu",
        "--quick",
        "--tiny",
        "--checks",
        "methods",
        "--methods",
        "zeroshot",
        "--budget-s",
        "0",
        "--out",
        str(out),
    ]
    assert gpu_check.main(argv) == 1
    report = json.loads(out.read_text())
    assert report["checks"]["methods"]["per_method"]["zeroshot"]["status"] == "skipped"
    assert report["status"] == "fail"


def test_unknown_names_are_errors_listing_the_options(gpu_check, tmp_path):
    with pytest.raises(SystemExit, match="unknown methods.*available: .*zeroshot"):
        gpu_check.main(["--device", "cpu", "--methods", "zeroshott", "--out", str(tmp_path / "r")])
    with pytest.raises(SystemExit, match="unknown checks"):
        gpu_check.main(["--device", "cpu", "--checks", "speed", "--out", str(tmp_path / "r")])


@pytest.mark.cuda
@needs_cuda
def test_quick_check_passes_on_cuda(gpu_check, tmp_path):
    out = tmp_path / "gpu.json"
    argv = [
        "--quick",
        "--methods",
        "zeroshot,tent,tda",
        "--shifts",
        "gaussian_noise,defocus_blur,snow,jpeg_compression",
        "--out",
        str(out),
    ]
    code = gpu_check.main(argv)
    report = json.loads(out.read_text())
    assert code == 0, json.dumps(report["checks"], indent=1)[:4000]
    assert report["env"]["device"].startswith("cuda")
    for r in report["checks"]["methods"]["per_method"].values():
        assert r["peak_memory_kind"] == "cuda_max_allocated" and r["peak_memory_bytes"] > 0


def test_golden_step_finds_a_set_and_skips_without_data(gpu_check, tmp_path):
    """The golden step picks the smallest cross-domain set present and is skipped, never
    failed, without data; a skip leaves the overall status to the other checks."""
    import fixtures_data as fx

    name, why = gpu_check.golden_set(None, None)
    assert name is None and "--data-dir" in why
    skipped = gpu_check.check_golden(torch.device("cpu"), None, None, ["zeroshot"], tmp_path)
    assert skipped["status"] == "skip"
    fx.coop_layout(tmp_path, "caltech101")
    fx.coop_layout(tmp_path, "dtd")
    assert gpu_check.golden_set(str(tmp_path), None) == ("dtd", "")
    assert gpu_check.golden_set(str(tmp_path), "caltech101") == ("caltech101", "")
    name, why = gpu_check.golden_set(str(tmp_path), "eurosat")
    assert name is None and "split_zhou_EuroSAT.json" in why
    assert gpu_check.overall_status({"a": {"status": "pass"}, "g": {"status": "skip"}}) == "pass"
    assert gpu_check.overall_status({"g": {"status": "skip"}}) == "fail"


def test_published_targets_match_the_readme_averages():
    """The golden rows (TDA README, RN50) against the averages the README prints."""
    import statistics

    from tta_bench import catalog

    pub = catalog.catalog()["published"]["tda-readme-rn50"]
    family = ["imagenet", "imagenet_a", "imagenet_v2", "imagenet_r", "imagenet_sketch"]
    for method, row in pub["accuracy"].items():
        assert len(row) == 15
        want = pub["averages"][method]
        cross = [v for k, v in row.items() if k not in family]
        assert round(statistics.fmean(row[k] for k in family), 2) == want["imagenet_family"]
        assert round(statistics.fmean(row[k] for k in family[1:]), 2) == want["natural_shifts"]
        assert round(statistics.fmean(cross), 2) == want["cross_domain"]


def test_each_published_row_says_which_text_head_it_used(gpu_check):
    """Every published row names its head per row or per set: a catalogue template set,
    ``official``, or null; the TDA README's "CLIP-ResNet-50" row is the prompt ensemble of
    TPT's README on the ImageNet family, not its single-prompt row (kdiAAA/TDA#9)."""
    from tta_bench import catalog

    found = catalog.catalog()
    published, sets = found["published"], found["templates"]
    for name, entry in published.items():
        assert set(entry["prompts"]) == set(entry["accuracy"]) == set(entry["method"]), name
        for row, figures in entry["accuracy"].items():
            for dataset in figures:
                head = gpu_check.published_head(entry, row, dataset)
                assert head is None or head == "official" or head in sets, (name, row, head)
    tda, tpt = published["tda-readme-rn50"], published["tpt-readme-rn50"]
    family = ["imagenet", "imagenet_a", "imagenet_v2", "imagenet_r", "imagenet_sketch"]
    ensemble = {k: tda["accuracy"]["zeroshot"][k] for k in family}
    assert ensemble == tpt["accuracy"]["zeroshot_ensemble"] != tpt["accuracy"]["zeroshot"]
    for d in family:
        assert gpu_check.published_head(tda, "zeroshot", d) == "clip-imagenet-80"
        assert gpu_check.published_head(tpt, "zeroshot_ensemble", d) == "clip-imagenet-80"
        assert gpu_check.published_head(tpt, "zeroshot", d) == "simple"
    assert gpu_check.published_head(tda, "zeroshot", "dtd") is None
    assert gpu_check.published_head(tda, "tda", "dtd") == "official"


def test_the_golden_run_takes_the_published_head(gpu_check):
    assert gpu_check.head_overrides(None) == []
    assert gpu_check.head_overrides("official") == ["method.text_head=official"]
    assert gpu_check.head_overrides("simple") == ["protocol.templates=simple"]


def test_tpt_readme_rows_match_its_averages():
    import statistics

    from tta_bench import catalog

    pub = catalog.catalog()["published"]["tpt-readme-rn50"]
    for row, figures in pub["accuracy"].items():
        values = list(figures.values())
        assert round(statistics.fmean(values), 2) == pub["averages"][row]["imagenet_family"]
        assert round(statistics.fmean(values[1:]), 2) == pub["averages"][row]["natural_shifts"]
