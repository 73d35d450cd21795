"""Bad input to ``tta-bench run`` exits 2 before any setup (no model is built, nothing is
written), with a message naming the bad value."""

from __future__ import annotations

import pytest

import tta_bench
from tta_bench.registry import RegistryError

from .helpers import cli, scores, strict_json


@pytest.fixture()
def run_cli(capsys, tmp_path):
    """``tta-bench run --quiet ARGS`` in this process -> (status, stderr); asserts that no
    model was built and no results file written."""
    from tta_bench_testplugin import model

    def call(*args: str, output: str | None = None) -> tuple[int, str]:
        output = output or str(tmp_path / "out" / "r.json")
        before, files = model.builds, sorted(tmp_path.rglob("*"))
        rc, out, err = cli(capsys, "run", "--quiet", "--output", output, *args)
        assert model.builds == before, "a model was built before the input was checked"
        assert sorted(tmp_path.rglob("*")) == files, "something was written"
        return rc, err

    return call


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["seeds=[]"], "seeds=[] names no seed"),
        (["seeds=[0,0]"], "seeds=[0, 0] repeats a seed"),
        (["device=tpu"], "'tpu'"),
        (["device=cuda:7"], "'cuda:7'"),
        (["cache=sometimes"], "unknown cache policy 'sometimes'; available: auto, always, never"),
        (["--method", "norm_tnet"], "unknown method 'norm_tnet'. Did you mean 'norm_tent'?"),
        (["--suite", "tiny-shfits"], "unknown suite 'tiny-shfits'. Did you mean 'tiny-shifts'"),
        (["--model", "tiny-clap"], "unknown model 'tiny-clap'. Did you mean 'tiny-clip'?"),
        (["--method", "norm_tent", "+method.lrr=1"], "'method.lrr' (did you mean 'method.lr'?)"),
        (["--method", "norm_tent", "method.lrr=1"], "lrr"),
        (["--method", "norm_tent", "method.loss=entropie"], "unknown loss 'entropie'"),
        (["model.widht=3"], "model.widht"),
        (["+model.widht=3"], "'model.widht' (did you mean 'model.width'?)"),
        (["model.width=0"], "model tiny-clip: width must be >= 1, got 0"),
        (["protocol.shifts=[nosie]"], "unknown shift 'nosie'. Did you mean 'noise'?"),
        # keys composed in with '+' that no config has: refused, not ignored
        (["+severities=[6]"], "unknown option 'severities' (did you mean 'protocol.severities'?)"),
        (["+foo=1"], "unknown option 'foo'; the run's options: method, model, suite"),
        (["+protocol.sev=1"], "unknown option 'protocol.sev'; protocol's options:"),
        # numeric values outside their declared range, non-finite numbers, unknown choices
        (
            ["--method", "norm_tent", "method.steps=-1"],
            "method.steps=-1 is out of range: it must be >= 1",
        ),
        (
            ["--method", "norm_tent", "method.steps=0"],
            "method.steps=0 is out of range: it must be >= 1",
        ),
        (
            ["--method", "norm_tent", "method.lr=-1"],
            "method.lr=-1.0 is out of range: it must be > 0",
        ),
        (["--method", "norm_tent", "method.lr=nan"], "method.lr=nan: not a finite number"),
        (
            ["--method", "norm_tent", "method.momentum=2"],
            "method.momentum=2.0 is out of range: it must be >= 0 and <= 1",
        ),
        (
            ["--method", "norm_tent", "method.optimizer=adamx"],
            "unknown method.optimizer='adamx'; available: adam, adamw, sgd",
        ),
        (["protocol.batch_size=0"], "protocol.batch_size=0 is out of range: it must be >= 1"),
        (["protocol.max_images=-5"], "protocol.max_images=-5 is out of range"),
        (["loader.num_workers=-1"], "loader.num_workers=-1 is out of range: it must be >= 0"),
        (["protocol.severities=[7]"], "severities must be in 1..5, got [7]"),
        (["protocol.reset=forever"], "unknown reset policy 'forever'"),
        (["--suite", "tiny-folder"], "dataset folder: the folder dataset reads class subfolders"),
        (
            ["--method", "needs_source", "--suite", "tiny-continual"],
            "method 'needs_source' needs 6 clean source-domain images, but suite "
            "'tiny-continual' declares no source split",
        ),
    ],
)
def test_bad_input_exits_2_before_setup_naming_the_value(run_cli, args, expected):
    rc, err = run_cli(*args)
    assert rc == 2
    assert err.startswith("tta-bench: error: ") and expected in err, err
    assert "Traceback" not in err


def test_cfg_fails_like_run_on_a_misspelled_shift(run_cli, capsys):
    for extra in ([], ["--cfg"]):
        rc, err = run_cli("protocol.shifts=[nosie]", *extra)
        assert rc == 2 and "unknown shift 'nosie'. Did you mean 'noise'?" in err
    rc, out, _ = cli(capsys, "run", "--cfg", "protocol.shifts=[noise]")
    assert rc == 0 and "# protocol: tiny-shifts@v1" in out


def test_an_output_under_a_file_is_refused(run_cli, tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    rc, err = run_cli(output=str(blocker / "sub" / "r.json"))
    assert rc == 2
    assert f"--output '{blocker / 'sub' / 'r.json'}'" in err and "is a file" in err


@pytest.mark.parametrize("where", ["/proc/tta-bench-test/r.json", "/sys/tta-bench-test.json"])
def test_an_output_in_an_unwritable_place_is_refused(run_cli, where):
    # Permissions do not stop root; /proc and /sys refuse new files to everyone.
    rc, err = run_cli(output=where)
    assert rc == 2 and f"--output '{where}'" in err and "cannot write" in err


def test_an_output_that_is_a_directory_is_refused(run_cli, tmp_path):
    (tmp_path / "dir").mkdir()
    rc, err = run_cli(output=str(tmp_path / "dir"))
    assert rc == 2 and "is a directory" in err


def test_an_output_holding_another_run_is_refused(run_cli, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc, _, err = cli(capsys, "run", "--quiet", "--output", str(out), "--method", "colour_oracle")
    assert rc == 0, err
    rc, err = run_cli(output=str(out))  # zeroshot into colour_oracle's file
    assert rc == 2 and "holds a different run" in err and str(out) in err


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"seeds": []}, "seeds=[] names no seed"),
        ({"device": "tpu"}, "'tpu'"),
        (
            {"method": "norm_tent", "overrides": ["+method.lrr=1"]},
            "'method.lrr' (did you mean 'method.lr'?)",
        ),
        ({"overrides": ["cache=sometimes"]}, "unknown cache policy 'sometimes'"),
        ({"overrides": ["protocol.shifts=[nosie]"]}, "unknown shift 'nosie'"),
        ({"method": "needs_source", "suite": "tiny-continual"}, "declares no source split"),
    ],
)
def test_the_python_api_refuses_what_the_cli_refuses(kwargs, expected):
    from tta_bench_testplugin import model

    before = model.builds
    kwargs = {"suite": "tiny-shifts", **kwargs}
    with pytest.raises((ValueError, RegistryError)) as info:
        tta_bench.evaluate(**kwargs)
    assert expected in str(info.value)
    assert model.builds == before


def test_the_python_api_gives_the_record_the_cli_writes(tmp_path, capsys):
    record = tta_bench.evaluate(method="colour_oracle", suite="tiny-shifts", device="cpu")
    rc, _, err = cli(capsys, "run", "--quiet", "--method", "colour_oracle", "device=cpu",
                     "--output", str(tmp_path / "r.json"))  # fmt: skip
    assert rc == 0, err
    written = strict_json(tmp_path / "r.json")
    assert scores(record) == scores(written)
    assert record["protocol"] == written["protocol"]
    assert {**record["config"], "output": None} == {**written["config"], "output": None}


# -- TTA_BENCH_CACHE_BUDGET_GB: one parser, every command that reads the cache refuses it ----
BAD_BUDGETS = ["abc", "-1", "nan", "inf", "1e999", " "]


def _budget_message(value: str) -> str:
    return (
        f"tta-bench: error: TTA_BENCH_CACHE_BUDGET_GB={value!r}: expected a finite number of "
        "gigabytes >= 0 (e.g. 50 or 0.5), or unset it for the default (50)\n"
    )


@pytest.mark.parametrize("value", BAD_BUDGETS)
@pytest.mark.parametrize(
    "argv",
    [("env",), ("env", "--json"), ("cache", "list"), ("cache", "clear", "--kind", "decoded")],
    ids=["env", "env-json", "cache-list", "cache-clear"],
)
def test_a_bad_cache_budget_is_refused_by_env_and_cache(capsys, monkeypatch, argv, value):
    monkeypatch.setenv("TTA_BENCH_CACHE_BUDGET_GB", value)
    rc, out, err = cli(capsys, *argv)
    assert (rc, out, err) == (2, "", _budget_message(value))


@pytest.mark.parametrize("value", ["abc", "nan", "-1"])
def test_a_bad_cache_budget_is_refused_by_run_before_setup(run_cli, monkeypatch, value):
    monkeypatch.setenv("TTA_BENCH_CACHE_BUDGET_GB", value)
    rc, err = run_cli("seeds=[0]", "cache=always")
    assert (rc, err) == (2, _budget_message(value))


@pytest.mark.parametrize("argv", [("profile", "--batches", "1"), ("sweep", "method=zeroshot")])
def test_a_bad_cache_budget_is_refused_by_profile_and_sweep(capsys, monkeypatch, tmp_path, argv):
    from tta_bench_testplugin import model

    monkeypatch.setenv("TTA_BENCH_CACHE_BUDGET_GB", "nan")
    before = model.builds
    extra = ["--dir", str(tmp_path / "sweep")] if argv[0] == "sweep" else []
    rc, out, err = cli(capsys, *argv, *extra, "seeds=[0]")
    assert (rc, err) == (2, _budget_message("nan"))
    assert model.builds == before and not (tmp_path / "sweep").exists()


@pytest.mark.parametrize(("value", "gb"), [(None, 50.0), ("", 50.0), ("0", 0.0), ("2.5", 2.5)])
def test_a_good_cache_budget_is_read_in_one_place(monkeypatch, value, gb):
    from tta_bench.run import cache

    if value is None:
        monkeypatch.delenv("TTA_BENCH_CACHE_BUDGET_GB", raising=False)
    else:
        monkeypatch.setenv("TTA_BENCH_CACHE_BUDGET_GB", value)
    assert cache.cache_budget_gb() == gb
    assert cache.cache_budget_bytes() == int(gb * 2**30)


@pytest.mark.parametrize("value", BAD_BUDGETS)
def test_the_api_refuses_a_bad_cache_budget_with_a_value_error(monkeypatch, value):
    from tta_bench.run import cache

    monkeypatch.setenv("TTA_BENCH_CACHE_BUDGET_GB", value)
    with pytest.raises(ValueError) as info:
        cache.cache_budget_bytes()
    assert str(info.value) == _budget_message(value).removeprefix("tta-bench: error: ").strip()


# -- sweep: every name of every value list checked before anything is launched ---------------
@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["method=norm_tnet,zeroshot"], "unknown method 'norm_tnet'. Did you mean 'norm_tent'?"),
        (["method=zeroshot,norm_tnet"], "unknown method 'norm_tnet'. Did you mean 'norm_tent'?"),
        (["method=choice(zeroshot,zeroshoot)"], "unknown method 'zeroshoot'. Did you mean"),
        (["model=tiny-clap"], "unknown model 'tiny-clap'. Did you mean 'tiny-clip'?"),
        (
            ["method=zeroshot", "suite=tiny-shifts,tiny-shfits"],
            "unknown suite 'tiny-shfits'. Did you mean 'tiny-shifts'",
        ),
    ],
)
def test_a_sweep_refuses_an_unknown_name_in_any_value_list(capsys, tmp_path, overrides, expected):
    from tta_bench_testplugin import model

    before = model.builds
    sweep_dir = tmp_path / "sweep"
    rc, out, err = cli(capsys, "sweep", "--dir", str(sweep_dir), "seeds=[0]", *overrides)
    assert rc == 2, err
    assert err.startswith("tta-bench: error: ") and expected in err and "Available: " in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert model.builds == before and not sweep_dir.exists()


def test_the_sweep_check_takes_registered_names_and_presets():
    from tta_bench.run import sweep

    sweep.check_choices(["method=zeroshot,norm_tent", "model=tiny-clip", "suite=tiny-shifts"])
    sweep.check_choices(["method=glob(*)", "seeds=[0],[1]", "+method.lr=1,2"])
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        sweep.check_choices(["method=zeroshot", "method=nope"])
