"""Local components without packaging: ``--include FILE_OR_DIR`` (lm-eval's ``--include_path``).

An included path is a Python file, a YAML catalogue file, or a directory (every ``*.py``
and ``*.yaml`` directly in it, sorted by name; files starting with ``_`` are left out).
What they hold goes through the same registries and checks as entry points:

* a **Python file** declares what it registers in one module-level dictionary literal,
  read without importing the file (listing stays cheap, as entry points do)::

      TTA_BENCH = {
          "methods": {"my-method": MyMethod},
          "losses": {"my-loss": my_loss},
      }

  Its keys are component kinds (``methods``, ``losses``, ``shifts``, ``datasets``,
  ``models``, ``metrics``), each a dictionary literal from string names to objects of
  the module. The file is imported (as a module of its own; its folder is not put on
  ``sys.path``) when one of its components is first loaded, and the object found under
  the declared name is validated like an entry point's. Nothing is registered by import
  side effects: an object the dictionary does not name is not a component.
* a **YAML file** is a catalogue, with the sections of a plugin's ``registry.yaml``
  (descriptions, datasets' class names and templates, template sets, suites).

Each file is the origin of what it declares: distribution ``local:<absolute path>``,
version the first 12 hex characters of the file's SHA-256. A name that an installed
distribution (or another included file) also registers is an error naming both origins.
Results list every included file with its full SHA-256 (``provenance.includes``).

The included paths live in the environment variable ``TTA_BENCH_INCLUDE`` (paths joined by
``os.pathsep``), so processes a command starts (sweep launchers) see them too;
``add_include`` sets it, ``included(...)`` sets it for a block. The registries and the
catalogue read this module (``declared``, ``catalogues``) and rescan when ``state()``
changes; this module imports no other module of the harness.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib.util
import os
import re
import stat
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

#: The included paths (absolute, joined by ``os.pathsep``).
INCLUDE_ENV = "TTA_BENCH_INCLUDE"
#: The module-level name an included Python file declares its components under.
DECLARATION = "TTA_BENCH"
#: The component kinds a Python file may declare (Hydra config packages need a package).
COMPONENT_KINDS = ("methods", "losses", "shifts", "datasets", "models", "metrics")
_SINGULAR = {k: k.removesuffix("es" if k == "losses" else "s") for k in COMPONENT_KINDS}
PY_SUFFIXES = (".py",)
YAML_SUFFIXES = (".yaml", ".yml")


class IncludeError(LookupError, ValueError):
    """An included path that does not exist, is not a regular file or directory (a FIFO is
    refused without being opened), is not a Python or YAML file, is not UTF-8 text, or whose
    declaration or catalogue is malformed; the message names the file. The registries and
    the catalogue raise it as their ``RegistryError``; the CLI exits 2."""


@dataclass(frozen=True)
class IncludedFile:
    """One included file: its absolute path, full SHA-256 and kind (``python``/``yaml``)."""

    path: Path
    sha256: str
    kind: str

    @property
    def distribution(self) -> str:
        return f"local:{self.path}"

    @property
    def version(self) -> str:
        return self.sha256[:12]

    def as_dict(self) -> dict[str, str]:
        return {"path": str(self.path), "sha256": self.sha256, "kind": self.kind}


# -- which paths are included ------------------------------------------------------------
def include_paths() -> list[str]:
    """The included paths, in the order they were given (``TTA_BENCH_INCLUDE``)."""
    value = os.environ.get(INCLUDE_ENV, "")
    return [p for p in value.split(os.pathsep) if p]


def _expand(path: str) -> list[Path]:
    """The files of one included path (a file, or a directory's ``*.py``/``*.yaml``)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise IncludeError(f"--include {path!r}: no such file or directory")
    p = p.resolve()
    if p.is_dir():
        found = sorted(
            f
            for f in p.iterdir()
            if f.suffix.lower() in PY_SUFFIXES + YAML_SUFFIXES
            and not f.name.startswith(("_", "."))
            and not f.is_dir()
        )
        for f in found:
            _check_regular(f, str(f))
        return found
    _check_regular(p, path)
    if p.suffix.lower() not in PY_SUFFIXES + YAML_SUFFIXES:
        raise IncludeError(
            f"--include {path!r}: not a Python (.py) or YAML (.yaml, .yml) file, nor a directory"
        )
    return [p]


def _check_regular(p: Path, given: str) -> None:
    """An ``IncludeError`` naming ``given`` unless ``p`` is a regular file (links followed).
    Decided by ``stat`` alone: opening a FIFO would wait for a writer."""
    if not p.is_file():
        raise IncludeError(
            f"--include {given!r}: not a regular file ({_file_type(p)}); give a Python (.py) "
            "or YAML (.yaml, .yml) file, or a directory of them"
        )


def _file_type(p: Path) -> str:
    """What a path that is neither a directory nor a regular file is, in words."""
    try:
        mode = p.stat().st_mode
    except OSError:  # a link that leads nowhere (or in a loop)
        return "a broken link"
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "a special file"


def _utf8(path: Path, data: bytes) -> str:
    """``data`` (the bytes of the included file ``path``) as text; an ``IncludeError``
    naming the file and the first bad byte when it is not UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = data[exc.start : exc.start + 1].hex()
        raise IncludeError(
            f"--include {str(path)!r}: not UTF-8 text (invalid byte 0x{bad} at offset "
            f"{exc.start}); save it as UTF-8"
        ) from None


def _read(path: Path) -> bytes:
    """The bytes of an included file; an ``IncludeError`` naming it when it cannot be read."""
    try:
        return path.read_bytes()
    except OSError as exc:
        raise IncludeError(
            f"--include {str(path)!r}: cannot be read ({exc.strerror or exc})"
        ) from None


_FILES: tuple[str, list[IncludedFile]] | None = None
#: Bumped by ``add_include``: the same paths included again are read again (edited files).
_GENERATION = [0]


def state() -> str:
    """What the included components depend on (the paths and how often they were added):
    the registries and the catalogue rescan when it changes."""
    return f"{os.environ.get(INCLUDE_ENV, '')}|{_GENERATION[0]}"


def included_files() -> list[IncludedFile]:
    """Every included file, each once, in the order given (a directory's sorted)."""
    global _FILES
    key = state()
    if _FILES is None or _FILES[0] != key:
        files: list[IncludedFile] = []
        seen: set[Path] = set()
        for path in include_paths():
            for f in _expand(path):
                if f in seen:
                    continue
                seen.add(f)
                kind = "python" if f.suffix.lower() in PY_SUFFIXES else "yaml"
                data = _read(f)
                _utf8(f, data)  # every file is text: refused here, naming it
                files.append(IncludedFile(f, hashlib.sha256(data).hexdigest(), kind))
        _FILES = (key, files)
    return list(_FILES[1])


def add_include(*paths: str | os.PathLike[str]) -> list[IncludedFile]:
    """Include ``paths`` in this process (and the processes it starts): each is checked
    now (it exists; each Python file's declaration parses, each YAML file is a mapping of
    sections; the catalogue checks section names when it is read), and an error names the
    bad file. The registries rescan on their next use. Returns the included files."""
    resolved = []
    for path in paths:
        _expand(str(path))  # exists, has a known suffix
        resolved.append(str(Path(path).expanduser().resolve()))
    os.environ[INCLUDE_ENV] = os.pathsep.join(dict.fromkeys([*include_paths(), *resolved]))
    _GENERATION[0] += 1
    files = included_files()
    for f in files:  # read each declaration and catalogue now: a bad file fails here
        if f.kind == "python":
            _declaration(f)
        else:
            read_catalogue(f)
    return files


@contextlib.contextmanager
def included(*paths: str | os.PathLike[str]) -> Iterator[list[IncludedFile]]:
    """``add_include(*paths)`` for the block, then the previous includes again (and the
    registries rescan); without ``paths`` the block runs with what is included already."""
    if not paths:
        yield included_files()
        return
    saved = os.environ.get(INCLUDE_ENV)
    try:
        yield add_include(*paths)
    finally:
        if saved is None:
            os.environ.pop(INCLUDE_ENV, None)
        else:
            os.environ[INCLUDE_ENV] = saved
        _GENERATION[0] += 1


# -- Python files: the declaration, read without importing -----------------------------
_DECLARATIONS: dict[tuple[Path, str], dict[str, dict[str, str]]] = {}
_MODULES: dict[tuple[Path, str], ModuleType] = {}


def _declaration(f: IncludedFile) -> dict[str, dict[str, str]]:
    """``{kind: {name: source of the object's expression}}`` of a Python file's
    ``TTA_BENCH`` literal, parsed (not executed)."""
    key = (f.path, f.sha256)
    if key in _DECLARATIONS:
        return _DECLARATIONS[key]
    where = f"included file {f.path}"
    source = _utf8(f.path, _read(f.path))
    try:
        tree = ast.parse(source, filename=str(f.path))
    except SyntaxError as exc:
        raise IncludeError(f"{where}: syntax error line {exc.lineno}: {exc.msg}") from None
    found = [
        node.value
        for node in tree.body
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        and node.value is not None
        and any(
            isinstance(t, ast.Name) and t.id == DECLARATION
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        )
    ]
    example = f'{DECLARATION} = {{"methods": {{"my-method": MyMethod}}}}'
    if not found:
        raise IncludeError(
            f"{where} declares no components: add a module-level `{example}` "
            f"(kinds: {', '.join(COMPONENT_KINDS)})"
        )
    if len(found) > 1:
        raise IncludeError(f"{where} assigns {DECLARATION} {len(found)} times; assign it once")
    value = found[0]
    if not isinstance(value, ast.Dict):
        raise IncludeError(f"{where}: {DECLARATION} must be a dictionary literal, e.g. `{example}`")
    out: dict[str, dict[str, str]] = {}
    for k, v in zip(value.keys, value.values):
        kind = k.value if isinstance(k, ast.Constant) else None
        if kind not in COMPONENT_KINDS:
            shown = ast.unparse(k) if k is not None else "**"
            raise IncludeError(
                f"{where}: {DECLARATION} key {shown} is not a component kind; "
                f"expected one of {', '.join(COMPONENT_KINDS)}"
            )
        if not isinstance(v, ast.Dict):
            raise IncludeError(
                f"{where}: {DECLARATION}[{kind!r}] must be a dictionary literal of names to "
                f"objects, e.g. {{'my-name': my_object}}"
            )
        names: dict[str, str] = {}
        for nk, nv in zip(v.keys, v.values):
            if not (isinstance(nk, ast.Constant) and isinstance(nk.value, str) and nk.value):
                shown = ast.unparse(nk) if nk is not None else "**"
                raise IncludeError(
                    f"{where}: {DECLARATION}[{kind!r}] key {shown} is not a non-empty string"
                )
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", nk.value):
                raise IncludeError(
                    f"{where}: {_SINGULAR[kind]} name {nk.value!r} must be letters, numerals, "
                    "'_', '-' or '.', starting with a letter or numeral"
                )
            if nk.value in names:
                raise IncludeError(f"{where}: {_SINGULAR[kind]} {nk.value!r} is declared twice")
            names[nk.value] = ast.unparse(nv)
        out[str(kind)] = names
    _DECLARATIONS[key] = out
    return out


def _module(f: IncludedFile) -> ModuleType:
    """The included file imported as a module of its own (once per content)."""
    key = (f.path, f.sha256)
    if key not in _MODULES:
        stem = re.sub(r"\W", "_", f.path.stem)
        where = hashlib.sha256(str(f.path).encode()).hexdigest()[:8]
        name = f"tta_bench_include_{stem}_{where}_{f.version}"
        spec = importlib.util.spec_from_file_location(name, f.path)
        if spec is None or spec.loader is None:
            raise IncludeError(f"included file {f.path} cannot be imported")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickling look their module up
        try:
            spec.loader.exec_module(module)
        except Exception:
            sys.modules.pop(name, None)
            raise
        _MODULES[key] = module
    return _MODULES[key]


def _loader(f: IncludedFile, kind: str, name: str) -> Callable[[], Any]:
    def load() -> Any:
        declared = getattr(_module(f), DECLARATION, None)
        try:
            return declared[kind][name]  # type: ignore[index]
        except (TypeError, KeyError):
            raise IncludeError(
                f"included file {f.path}: {DECLARATION}[{kind!r}][{name!r}] is declared in the "
                "file's text but absent when it is imported"
            ) from None

    return load


@dataclass(frozen=True)
class Declared:
    """One component an included Python file declares: what the registry makes its
    ``Origin`` of (``value`` is ``<path>:<the object's expression>``), and its loader."""

    name: str
    value: str
    distribution: str
    version: str
    load: Callable[[], Any]


def declared(kind: str) -> list[Declared]:
    """The components of ``kind`` the included Python files declare, in file order (the
    registries merge them with the entry points)."""
    if kind not in COMPONENT_KINDS:
        return []
    out = []
    for f in included_files():
        if f.kind != "python":
            continue
        for name, expr in _declaration(f).get(kind, {}).items():
            value = f"{f.path}:{expr}"
            out.append(Declared(name, value, f.distribution, f.version, _loader(f, kind, name)))
    return out


# -- YAML files: catalogues -----------------------------------------------------------
def read_catalogue(f: IncludedFile) -> dict[str, Any]:
    """An included YAML file's sections (the catalogue checks their names)."""
    import yaml

    text = _utf8(f.path, _read(f.path))
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise IncludeError(f"included catalogue {f.path}: {type(exc).__name__}: {exc}") from None
    if not isinstance(data, dict) or not all(
        isinstance(v, dict) or v is None for k, v in data.items() if k != "schema_version"
    ):
        raise IncludeError(
            f"included catalogue {f.path}: each section must be a mapping of names to entries"
        )
    return data


def catalogues() -> list[tuple[IncludedFile, dict[str, Any]]]:
    """``(file, sections)`` of each included YAML catalogue (merged after the installed
    ones; its origin is ``file.distribution``)."""
    return [(f, read_catalogue(f)) for f in included_files() if f.kind == "yaml"]


def provenance() -> list[dict[str, str]]:
    """What a results record lists under ``provenance.includes``: each included file's path,
    full SHA-256 and kind."""
    return [f.as_dict() for f in included_files()]
