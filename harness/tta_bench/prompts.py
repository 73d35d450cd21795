"""The protocol's prompt modes: templates, per-class sentences (CuPL's format), or both.

A text head is built from prompts. ``templates`` (the default) formats the protocol's
templates with every class name, as CLIP's zero-shot classifier does. ``cupl`` reads the
per-class sentences of a JSON file in CuPL's published format, ``{class name: [sentence,
...]}`` (one sentence list per class, each sentence a complete prompt), and ``all`` uses
both: per class, the formatted templates followed by its sentences. Each prompt is one
vote: a class embedding is the normalised mean of the normalised embeddings of all its
prompts (the reference harness's ``CLIP.PROMPT_MODE`` ``cupl`` and ``all_prompts``).

Runs select a mode with ``protocol.text_head=cupl|all`` and the file with
``protocol.prompts=FILE``. The protocol id holds the file's content digest (``identity``),
never its path, so the same sentences give the same id on any machine, and an edited file
another. Methods that encode prompts themselves from the protocol's templates (prompt
tuning, per-template heads) declare the modes they support (``Method.text_heads``); a run
of any other mode is refused before anything is built (``check_method``).

Prompt templates, the text head's other half: ``resolve_templates`` is the one resolver,
with one rule for every place that takes them (suites, dataset factories, ``Adapter``,
``predict``, ``serve``). A template set is either the name of a catalogue set (``templates:``
in a ``registry.yaml``) or a list of format strings, each with exactly one ``{}`` where the
class name goes; resolving reads YAML only, no torch.

Reading a file needs no torch; the class names are checked when the head is built (every
class of the stream must have at least one sentence; extra keys are allowed, as CuPL's
files cover whole datasets).
"""

from __future__ import annotations

import difflib
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "TEXT_HEADS",
    "DEFAULT_HEAD",
    "load_class_prompts",
    "identity",
    "check_head",
    "check_method",
    "prompts_for_classes",
    "resolve_templates",
    "class_prompt_lists",
]

#: The protocol's prompt modes; ``templates`` is the default and is left out of the id.
TEXT_HEADS = ("templates", "cupl", "all")
DEFAULT_HEAD = "templates"


def load_class_prompts(
    path: str | Path, *, owner: str = "protocol.prompts"
) -> dict[str, list[str]]:
    """The per-class sentences of the JSON file ``path``: a non-empty object whose keys are
    class names and whose values are non-empty lists of non-empty strings. Anything else
    (a missing or unreadable file, bad JSON, a wrong shape) is a ``ValueError`` naming
    ``owner``, the file and what is wrong."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"{owner}={str(path)!r}: no such file (a JSON of class -> sentences)")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{owner}={str(path)!r} is not readable JSON: {exc}") from None
    if not isinstance(data, dict) or not data:
        raise ValueError(
            f"{owner}={str(path)!r} must be a non-empty JSON object of class name -> list of "
            f"sentences (CuPL's format), got {type(data).__name__}"
        )
    bad = [
        name
        for name, sentences in data.items()
        if not isinstance(sentences, list)
        or not sentences
        or not all(isinstance(s, str) and s.strip() for s in sentences)
    ]
    if bad:
        shown = ", ".join(repr(b) for b in bad[:5]) + (", ..." if len(bad) > 5 else "")
        raise ValueError(
            f"{owner}={str(path)!r}: every class needs a non-empty list of non-empty "
            f"sentences; not so for {len(bad)} class(es): {shown}"
        )
    return {str(k): [str(s) for s in v] for k, v in data.items()}


def _digest(prompts: dict[str, list[str]]) -> str:
    blob = json.dumps(prompts, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def identity(prompts: dict[str, list[str]]) -> dict[str, Any]:
    """What the protocol id records of a prompts file: the SHA-256 of its content (keys
    sorted, whitespace between JSON tokens ignored), its class and sentence counts."""
    return {
        "sha256": _digest(prompts),
        "classes": len(prompts),
        "sentences": sum(len(v) for v in prompts.values()),
    }


def check_head(text_head: str | None, prompts_file: str | None) -> str | None:
    """``text_head`` normalised (None for the default ``templates``, so ids from before the
    prompt modes hold); a ``ValueError`` for an unknown mode, a sentence mode without a
    file, or a file no mode reads."""
    head = DEFAULT_HEAD if text_head is None else str(text_head)
    if head not in TEXT_HEADS:
        close = difflib.get_close_matches(head, TEXT_HEADS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"unknown protocol.text_head {head!r}{hint}; available: {', '.join(TEXT_HEADS)}"
        )
    if head != DEFAULT_HEAD and not prompts_file:
        raise ValueError(
            f"protocol.text_head={head} reads per-class sentences: name their JSON file with "
            "protocol.prompts=FILE ({class name: [sentence, ...]}, CuPL's format)"
        )
    if head == DEFAULT_HEAD and prompts_file:
        raise ValueError(
            f"protocol.prompts={prompts_file!r} is read only by protocol.text_head=cupl (the "
            "sentences alone) or all (templates and sentences); the head is 'templates'"
        )
    return None if head == DEFAULT_HEAD else head


def check_method(method: str, method_cls: Any, text_head: str | None) -> None:
    """A ``ValueError`` when ``method`` (its registered class ``method_cls``) cannot build
    the protocol's head ``text_head`` (None: templates): it names the modes it supports."""
    head = text_head or DEFAULT_HEAD
    supported = tuple(getattr(method_cls, "text_heads", TEXT_HEADS))
    if head not in supported:
        raise ValueError(
            f"method {method!r} encodes prompts from the protocol's templates itself and "
            f"supports protocol.text_head {', '.join(supported)}, not {head!r}; run it "
            "without protocol.text_head, or choose a method that reads the protocol's head"
        )


def prompts_for_classes(
    file: str, recorded: dict[str, Any], classnames: Sequence[str]
) -> dict[str, list[str]]:
    """The sentences of ``classnames`` from ``file``, whose content must still be what the
    protocol recorded (``recorded``: its ``identity``); a ``ValueError`` names a changed
    file, or the classes without sentences (with the file's closest keys)."""
    prompts = load_class_prompts(file)
    now = identity(prompts)
    if now["sha256"] != recorded.get("sha256"):
        raise ValueError(
            f"protocol.prompts file {file!r} changed since the protocol was resolved "
            f"(sha256 {now['sha256'][:12]} != {str(recorded.get('sha256'))[:12]})"
        )
    missing = [c for c in classnames if c not in prompts]
    if missing:
        hints = []
        for name in missing[:5]:
            close = difflib.get_close_matches(name, list(prompts), n=1)
            hints.append(f"{name!r}" + (f" (file has {close[0]!r})" if close else ""))
        more = ", ..." if len(missing) > 5 else ""
        raise ValueError(
            f"protocol.prompts file {file!r} has no sentences for {len(missing)} of "
            f"{len(classnames)} classes: {', '.join(hints)}{more}"
        )
    return {c: prompts[c] for c in classnames}


def resolve_templates(value: str | Sequence[str], *, owner: str = "") -> list[str]:
    """The templates of ``value`` (a catalogue set's name, or a list of format strings).

    An unknown set's name, an empty list, a non-string entry, or a template without exactly
    one ``{}`` is a ``ValueError`` naming ``owner`` (e.g. ``"suite 'my-suite'"``), the bad
    templates and the catalogue's sets."""
    from tta_bench import catalog

    where = f" of {owner}" if owner else ""
    sets = catalog.catalog()["templates"]
    if isinstance(value, str):
        if value not in sets:
            raise ValueError(
                f"unknown template set {value!r}{where}; available: "
                f"{', '.join(sorted(sets)) or 'none'} (or a list of format strings with one '{{}}')"
            )
        value = sets[value]["templates"]
    if not isinstance(value, Sequence) or not all(isinstance(t, str) for t in value):
        raise ValueError(
            f"prompt templates{where} must be a template set's name or a list of strings, "
            f"got {value!r}"
        )
    out = list(value)
    bad = [t for t in out if t.count("{}") != 1]
    if not out or bad:
        raise ValueError(
            f"prompt templates{where} need exactly one '{{}}' each (where the class name "
            f"goes); got {bad or out}"
        )
    return out


def class_prompt_lists(
    classnames: Sequence[str],
    templates: Sequence[str],
    class_prompts: dict[str, Sequence[str]],
) -> list[list[str]]:
    """Per class: the templates formatted with its name, then its own sentences."""
    return [[t.format(c) for t in templates] + list(class_prompts[c]) for c in classnames]
