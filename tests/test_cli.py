"""End-to-end CLI tests on the embedded default (real model, real data)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from tta_bench.cli import main

SMALL = ["protocol.shifts=[gaussian_noise,contrast]", "protocol.max_images=96", "--quiet"]
REQUIRED_CELL_KEYS = {
    "shift",
    "severity",
    "seed",
    "n",
    "accuracy",
    "time_per_sample_s",
    "peak_memory_bytes",
}


def _run(tmp_path, *args: str) -> tuple[int, dict]:
    out = tmp_path / "r.json"
    code = main(["run", *args, "--output", str(out)])
    return code, (json.loads(out.read_text()) if out.exists() else {})


def test_run_writes_the_results_schema(tmp_path, capsys):
    code, record = _run(tmp_path, "--method", "tent", *SMALL, "seeds=[0,1]")
    assert code == 0
    printed = capsys.readouterr().out
    assert "gaussian_noise" in printed and "mean" in printed and "ms/sample" in printed
    # the mean over seeds with its 95% CI, and the paired difference to the frozen model
    row = next(line for line in printed.splitlines() if line.startswith("tent  "))
    mean = 100 * record["summary"]["mean_accuracy"]
    assert f"{mean:.1f} ± " in row and " [" in row, row
    assert "accuracy % (95% CI)" in printed and "no interval over seeds" not in printed
    for key in (
        "schema_version",
        "method",
        "model",
        "suite",
        "config",
        "provenance",
        "cells",
        "summary",
        "protocol",
    ):
        assert key in record
    assert record["method"] == "tent" and record["suite"] == "digits-c"
    prov = record["provenance"]
    assert prov["packages"]["torch"] and prov["device"]["type"] == "cpu"
    malloc = prov["malloc"]  # where batch-sized blocks come from (timings depend on it)
    assert malloc["policy"] == "system"  # a run leaves the process's allocator alone
    assert malloc["recycled_buffers_max_bytes"] > 0
    assert {p["group"] for p in prov["plugins"]} >= {"tta_bench.methods", "tta_bench.shifts"}
    assert len(record["cells"]) == 4  # 2 shifts x 1 severity x 2 seeds
    for cell in record["cells"]:
        assert set(cell) >= REQUIRED_CELL_KEYS
        assert 0.0 <= cell["accuracy"] <= 1.0 and cell["n"] == 96
    assert record["summary"]["mean_accuracy"] == pytest.approx(
        sum(c["accuracy"] for c in record["cells"]) / 4
    )
    assert record["config"]["method"]["name"] == "tent"
    assert record["parameters"]["trainable"] > 0


@pytest.mark.slow
def test_same_seed_same_config_gives_identical_accuracies(tmp_path):
    accs = []
    small = ["protocol.shifts=[gaussian_noise,contrast]", "protocol.max_images=16", "--quiet"]
    for i in range(2):
        (tmp_path / str(i)).mkdir()
        _, record = _run(tmp_path / str(i), "--method", "mura", *small, "seeds=[0]")
        accs.append([c["accuracy"] for c in record["cells"]])
    assert accs[0] == accs[1]


def test_overrides_reach_the_method_and_the_protocol(tmp_path):
    code, record = _run(
        tmp_path,
        "--method",
        "tent",
        "method.lr=0.01",
        "method.steps=2",
        "protocol.batch_size=32",
        *SMALL,
    )
    assert code == 0
    assert record["method_config"]["lr"] == 0.01 and record["method_config"]["steps"] == 2
    assert record["protocol"]["batch_size"] == 32
    assert "bs32" in record["protocol"]["id"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--method", "mrua"], "Did you mean 'mura'"),
        (["--suite", "digits-cx"], "Did you mean 'digits-c'"),
        (["--model", "tiny-clip"], "unknown model 'tiny-clip'"),
        (["--method", "tent", "method.nonexistent=1"], "nonexistent"),
        (["--method", "tent", "bogus_key=1"], "bogus_key"),
        (["--method", "tent", "method.lr=fast"], "lr"),
        (["--method", "tent", "method.optimizer=rmsprop"], "available: adam, adamw, sgd"),
        (["--method", "tent", "method.loss=entropi"], "Did you mean 'entropy'"),
        (["protocol.reset=sometimes"], "available: episodic_batch"),
        (["protocol.shifts=[gausian_noise]"], "Did you mean 'gaussian_noise'"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(tmp_path, capsys, args, message):
    code = main(["run", *args, "--quiet", "--output", str(tmp_path / "r.json")])
    assert code == 2
    assert message in capsys.readouterr().err


def test_cfg_prints_the_resolved_config(capsys):
    assert main(["run", "--method", "mura", "method.lr=0.001", "seeds=[0,1,2]", "--cfg"]) == 0
    out = capsys.readouterr().out
    assert "name: mura" in out and "lr: 0.001" in out and "- 2" in out
    assert "# protocol: digits-c@v2" in out


def test_ls_methods_lists_the_methods(capsys):
    assert main(["ls", "methods"]) == 0
    out = capsys.readouterr().out
    for name in ("zeroshot", "tent", "mura"):
        assert name in out


def test_env_reports_versions_device_and_plugins(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for needle in ("torch", "CUDA available", "cuDNN", "device used", "cache dir", "tta-bench",
                   "allocator (CPU runs)"):  # fmt: skip
        assert needle in out


def test_console_script_refuses_a_misspelt_method():
    """The installed `tta-bench` entry point, as a user types it: a misspelt method exits 2
    naming the one meant. Its end-to-end run is tests/test_reproduce.py's zero-shot
    reproduction (the default suite through the console script, in a fresh process)."""
    bad = subprocess.run(["tta-bench", "run", "--method", "mrua"], capture_output=True, text=True)
    assert bad.returncode == 2 and "mura" in bad.stderr


def test_python_dash_m_entry(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "tta_bench.cli", "ls", "suites"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "digits-c-full" in done.stdout


def test_pass_counts_exclude_the_reference_forward(tmp_path):
    """A parameter-free method shares the frozen tower with the reference scoring; the
    reference forward must not be counted as the method's pass."""
    code, record = _run(tmp_path, "--method", "tda", *SMALL)
    assert code == 0
    for cell in record["cells"]:
        assert cell["reference_accuracy"] is not None
        assert cell["forward_passes_per_sample"] == 1.0
        assert cell["backward_passes_per_sample"] == 0.0


@pytest.mark.parametrize("method", ["zeroshot", "tda"])
def test_only_a_method_that_is_not_the_frozen_model_reruns_it_for_the_reference(tmp_path, method):
    """The reference (the frozen model's predictions) costs a forward per batch, except for
    the frozen model itself (``is_reference``): its own predictions are the reference, in
    the cells and in the per-sample files alike."""
    from method_runs import digits_c_spec

    from tta_bench.run import samples
    from tta_bench.run.runner import Evaluation

    protocol = {"shifts": ["contrast"], "max_images": 48}
    spec = digits_c_spec(method, [0], protocol, log_samples=samples.mode(True))
    spec = dataclasses.replace(spec, reference=True)
    out = tmp_path / "r.json"
    ev = Evaluation(spec, out)
    record = ev.run()
    reran = ev.phase_seconds.get("reference", 0.0) > 0
    assert reran == (method != "zeroshot"), ev.phase_seconds
    cell = record["cells"][0]
    table = samples.read_cell(samples.samples_dir(out), "contrast", cell["severity"], 0)
    refs = samples.references(table)
    assert refs is not None and len(refs) == cell["n"] == 48
    if method == "zeroshot":
        assert cell["reference_accuracy"] == cell["accuracy"]
        assert (refs == table.column("prediction").to_numpy()).all()


@pytest.mark.slow
def test_a_diverging_real_method_is_reported_never_scored(tmp_path, capsys):
    """tent with an absurd step produces non-finite logits: the cells say diverged (with
    the batch), the table prints it, the summary has no mean, the file is strict JSON."""
    out = tmp_path / "div.json"
    args = ["run", "--method", "tent-digits", "--quiet", "--output", str(out)]
    args += ["method.lr=1e30", "protocol.max_images=64"]
    args += ["protocol.shifts=[contrast,gaussian_noise]", "seeds=[0]", "progress=false"]
    assert main(args) == 0
    assert "diverged" in capsys.readouterr().out
    record = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"bare {c}"))
    assert all(c["diverged"]["reason"] == "non-finite logits" for c in record["cells"])
    assert all(c["accuracy"] is None for c in record["cells"])
    assert record["summary"]["mean_accuracy"] is None
    assert record["summary"]["n_diverged"] == 2
