"""Registry: entry points only, lazy, validated at load, duplicates and unknown names are
clear errors, and the catalogue (registry.yaml) matches the entry points."""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml
from processes import python_ok

from tta_bench import catalog
from tta_bench.registry import KINDS, RegistryError, UnknownNameError, registry

ROOT = Path(__file__).resolve().parents[1]


def _our_entry_points(kind: str, dist: str = "mura-plugin") -> set[str]:
    return {
        ep.name
        for ep in md.entry_points(group=f"tta_bench.{kind}")
        if ep.dist is not None and ep.dist.metadata["Name"] == dist
    }


CATALOGUES = {
    "mura-plugin": ROOT / "registry.yaml",
    "tta-bench": ROOT / "harness" / "tta_bench" / "registry.yaml",
}


@pytest.mark.parametrize("dist", sorted(CATALOGUES))
def test_the_catalogue_loader_reads_what_pyyamls_own_safe_loader_reads(dist):
    """The catalogue is parsed with libyaml's safe loader where PyYAML has it (faster);
    it must build exactly the data of the pure-Python one."""
    assert catalog.SAFE_LOADER is getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    text = CATALOGUES[dist].read_text(encoding="utf-8")
    assert yaml.load(text, Loader=catalog.SAFE_LOADER) == yaml.load(text, Loader=yaml.SafeLoader)


@pytest.mark.parametrize("dist", sorted(CATALOGUES))
@pytest.mark.parametrize("kind", KINDS)
def test_entry_points_and_catalogue_list_the_same_names(kind, dist):
    """Each distribution's entry points and its own registry.yaml name the same things."""
    data = yaml.safe_load(CATALOGUES[dist].read_text())
    # a figure the runner derives (a method's own OOD score metrics) is catalogued for its
    # table column but is no registered function: ``derived: true``
    in_catalogue = {n for n, e in (data.get(kind) or {}).items() if not (e or {}).get("derived")}
    assert _our_entry_points(kind, dist) == in_catalogue


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "configs"])
def test_every_component_has_a_description(kind):
    for name in _our_entry_points(kind) | _our_entry_points(kind, "tta-bench"):
        assert catalog.description(kind, name), f"{kind}/{name} has no description"


@pytest.mark.parametrize("kind", KINDS)
def test_every_registered_component_loads_and_validates(kind):
    reg = registry(kind)
    for name in reg.names():
        reg.get(name)


def test_unknown_name_suggests_close_matches():
    with pytest.raises(UnknownNameError) as err:
        registry("methods").get("mrua")
    msg = str(err.value)
    assert "Did you mean 'mura'" in msg
    assert "Available:" in msg and "tent" in msg and "zeroshot" in msg


def test_suites_reference_registered_components():
    from tta_bench.run.protocol import CLEAN

    for name, suite in catalog.catalog()["suites"].items():
        assert suite["dataset"] in registry("datasets"), name
        if suite.get("ood"):  # an open-set suite's OOD set
            assert suite["ood"]["dataset"] in registry("datasets"), name
        if suite.get("shift_source", "synthetic") == "synthetic":
            for shift in suite["shifts"]:  # a composite "A>B" (digits-ccc): both parts
                for part in shift.split(">"):  # clean: the harness's own identity shift
                    assert part in registry("shifts") or part == CLEAN, (name, shift)


def test_listing_does_not_import_torch():
    out = python_ok(
        "import sys\n"
        "from tta_bench.cli import main\n"
        "assert main(['ls']) == 0\n"
        "assert 'torch' not in sys.modules, 'tta-bench ls imported torch'\n"
    )
    assert "mura" in out.stdout and "digits-c" in out.stdout


def _write_dist(root: Path, dist: str, entry_points: str, files: dict[str, str]) -> None:
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(entry_points)
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def _registry_error(path, call: str) -> str:
    """The RegistryError message of ``call`` in a fresh interpreter with ``path`` on
    sys.path (entry points are read once per process)."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from tta_bench.registry import registry, RegistryError\n"
        f"try:\n    {call}\nexcept RegistryError as e:\n    print(e)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True
    ).stdout


@pytest.mark.parametrize(
    ("dist", "entry_points", "files", "call", "messages"),
    [
        (  # a name another distribution registers: an error naming both origins
            "clash-plugin",
            "[tta_bench.methods]\ntent = clash_plugin:Tent\n",
            {"clash_plugin/__init__.py": "Tent = None\n"},
            "registry('methods').names()",
            [
                "duplicate method name 'tent'",
                "clash_plugin:Tent (from clash-plugin 0.1)",
                "mura_plugin.methods.tent:Tent (from mura-plugin",
            ],
        ),
        (  # an invalid component fails at load, naming its origin
            "bad-plugin",
            "[tta_bench.shifts]\nbroken = bad_plugin:broken\n",
            {"bad_plugin/__init__.py": "def broken(images):\n    return images\n"},
            "registry('shifts').get('broken')",
            ["shift 'broken' (bad_plugin:broken from bad-plugin) is invalid"],
        ),
    ],
    ids=["duplicate_names_name_both_origins", "invalid_plugin_fails_at_load_with_its_origin"],
)
def test_a_bad_plugin_is_a_registry_error_naming_its_origin(
    tmp_path, dist, entry_points, files, call, messages
):
    _write_dist(tmp_path, dist, entry_points, files)
    out = _registry_error(tmp_path, call)
    for message in messages:
        assert message in out


def test_add_rejects_duplicates_and_invalid_objects():
    from tta_bench.registry import Registry, _validate_callable_with

    reg = Registry("losses", _validate_callable_with("logits"))
    with pytest.raises(RegistryError, match="duplicate loss name 'entropy'"):
        reg.add("entropy", lambda logits: logits)
    with pytest.raises(RegistryError, match="invalid"):
        reg.add("not_callable", 3)


def test_catalogue_and_weights_ship_inside_the_wheel(tmp_path):
    """The plugin's wheel carries its catalogue and the default model's weights; the
    harness's wheel carries its own catalogue."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("mura_plugin-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        shipped = zf.read("mura_plugin/registry.yaml").decode()
        weights = zf.read("mura_plugin/models/weights/tiny-clip-digits.safetensors")
        entry_points = zf.read(
            next(n for n in zf.namelist() if n.endswith("entry_points.txt"))
        ).decode()
    assert shipped == (ROOT / "registry.yaml").read_text()
    assert (
        weights == (ROOT / "mura_plugin/models/weights/tiny-clip-digits.safetensors").read_bytes()
    )
    assert "[tta_bench.catalogs]" in entry_points
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", str(tmp_path / "h"), str(ROOT / "harness")],
        check=True,
        capture_output=True,
    )
    (harness_wheel,) = (tmp_path / "h").glob("tta_bench-*.whl")
    with zipfile.ZipFile(harness_wheel) as zf:
        names = zf.namelist()
        assert "tta_bench/registry.yaml" in names
        assert not any(n.startswith("mura_plugin") for n in names)
