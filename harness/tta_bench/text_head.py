"""Class text embeddings (the zero-shot head) at any size, and their on-disk cache.

``encode_class_embeddings`` computes the prompt-ensemble head of a CLIP text tower: for
every class, the normalised mean over templates of the normalised ``encode_text`` features
of ``template.format(class)``. Prompts are tokenised and encoded in chunks of at most
``chunk_size`` prompts, accumulated into a running float32 sum per class, so peak memory
is one chunk's activations plus the ``[C, D]`` result, whatever ``classes x templates``
is (ImageNet's 1,000 classes x CLIP's 80 templates in one ``encode_text`` call needed a
12.6 GB activation at width 512).

``class_embeddings`` is the same computation behind a cache: ``cache_dir()/text-heads``,
one file per head, named by the SHA-256 of its key (``head_key``):

* the recipe version (``RECIPE_VERSION``: bump it when this computation changes);
* the text tower's weights: ``text_state_sha256`` (every state tensor outside
  ``visual.*`` and the logit scale/bias, memoised per module while its tensors are
  unchanged), with the tower's pooling attributes;
* the class names and the templates, in order (stored whole: a hit compares them);
* the tokenizer's identity (``tokenizer_identity``: its type, context length, a hash of
  its vocabulary when it has one, and the tokens of every class name and every template);
* where and how it was computed: device kind (CPU instruction set or GPU name), torch
  version, parameter dtype, chunk size; float rounding differs between them, and a cached
  head is what this machine would compute now, so a number never depends on cache history.

A hit returns exactly the tensor the miss computed (the miss writes what it returns).
Entries are written atomically (``paths.atomic_path``) under a per-entry file lock (a
second process waits for the first's result instead of recomputing it); a file that does
not parse, whose payload's checksum or shape is wrong, or whose stored key differs, is
warned about and recomputed, never trusted. ``TTA_BENCH_TEXT_CACHE=0`` turns the cache off.

``text_head_entries`` and ``clear_text_heads`` list and clear the cache without importing
torch (``tta-bench env`` / ``tta-bench cache``).

Prompt templates and the prompt modes (per-class sentences, ``encode_prompt_lists``) are
resolved in ``tta_bench.prompts``; ``resolve_templates`` is still importable from here.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import struct
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tta_bench.paths import atomic_path, cache_dir
from tta_bench.prompts import class_prompt_lists, resolve_templates

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "DEFAULT_CHUNK_PROMPTS",
    "RECIPE_VERSION",
    "CACHE_ENV",
    "encode_class_embeddings",
    "encode_prompt_lists",
    "class_embeddings",
    "head_key",
    "key_digest",
    "entry_path",
    "text_state_sha256",
    "tokenizer_identity",
    "text_head_dir",
    "text_head_entries",
    "clear_text_heads",
    "resolve_templates",  # from tta_bench.prompts, its home since the prompt modes
]

#: Prompts per ``encode_text`` call. At CLIP's width 512 and 77 tokens one chunk's largest
#: activation (the MLP's 4x hidden state) is 256 * 77 * 2048 * 4 B = 161 MB.
DEFAULT_CHUNK_PROMPTS = 256
#: Version of the head's computation (part of every cache key).
RECIPE_VERSION = 2  # 2: prompts cut after their longest end token (encode_text_cut)
#: ``0``/``off``/``false``/``no`` turns the text-head cache off.
CACHE_ENV = "TTA_BENCH_TEXT_CACHE"
#: Seconds a process waits for another one computing the same head before computing it too.
LOCK_TIMEOUT_S = 1800.0

_MAGIC = b"TTA-BENCH-TEXT-HEAD\n"
_FORMAT = 1
_SUFFIX = ".head"
_DTYPES = ("float32", "float16", "bfloat16", "float64")
_NOT_TEXT = ("logit_scale", "logit_bias")  # scale the logits, not the embeddings


# -- the computation ---------------------------------------------------------------------
def encode_class_embeddings(
    clip: nn.Module,
    tokenizer: Callable[[Sequence[str]], torch.Tensor],
    classnames: Sequence[str],
    templates: Sequence[str],
    *,
    chunk_size: int = DEFAULT_CHUNK_PROMPTS,
) -> torch.Tensor:
    """Class embeddings ``[C, D]``: per class, the L2-normalised mean over ``templates`` of
    the L2-normalised ``clip.encode_text`` features of ``template.format(class)``.

    Runs on the device of ``clip``'s parameters, in its current mode, without gradients.
    Each ``encode_text`` call takes at most ``chunk_size`` prompts: ``chunk_size //
    len(templates)`` whole classes at a time, or, for more templates than that, one class's
    templates in consecutive slices. Sums are float32 and their order is fixed (no atomics),
    so the result is deterministic for a device; it is returned in the features' dtype."""
    import torch

    classnames, templates = list(classnames), list(templates)
    if not classnames or not templates:
        raise ValueError(
            f"a text head needs class names and templates, got {len(classnames)} class names "
            f"and {len(templates)} templates"
        )
    _check_chunk_size(chunk_size)
    n_classes, n_templates = len(classnames), len(templates)
    per_call = min(n_templates, chunk_size)  # templates of one class per call
    classes_per_call = max(1, chunk_size // per_call)
    device = next(clip.parameters()).device
    sums: torch.Tensor | None = None
    out_dtype = torch.float32
    with torch.no_grad():
        for c0 in range(0, n_classes, classes_per_call):
            names = classnames[c0 : c0 + classes_per_call]
            for t0 in range(0, n_templates, per_call):
                tmpl = templates[t0 : t0 + per_call]
                tokens = tokenizer([t.format(c) for c in names for t in tmpl]).to(device)
                feats = encode_text_cut(clip, tokens)
                feats = feats / feats.norm(dim=-1, keepdim=True)
                part = feats.float().reshape(len(names), len(tmpl), -1).sum(dim=1)
                if sums is None:
                    sums = torch.zeros(n_classes, part.shape[1], device=device)
                    out_dtype = feats.dtype
                sums[c0 : c0 + len(names)] += part
        assert sums is not None
        mean = sums / n_templates
        return (mean / mean.norm(dim=-1, keepdim=True)).to(out_dtype)


def _check_chunk_size(chunk_size: Any) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(
            f"chunk_size must be a positive int (prompts per call), got {chunk_size!r}"
        )


def encode_prompt_lists(
    clip: nn.Module,
    tokenizer: Callable[[Sequence[str]], torch.Tensor],
    prompt_lists: Sequence[Sequence[str]],
    *,
    chunk_size: int = DEFAULT_CHUNK_PROMPTS,
) -> torch.Tensor:
    """Class embeddings ``[C, D]`` from each class's own prompts (lists of any length, e.g.
    templates and CuPL sentences; ``tta_bench.prompts``): per class, the L2-normalised mean
    of the L2-normalised ``encode_text`` features of its prompts. The prompts, class after
    class, are encoded ``chunk_size`` at a time; each class's float32 sum adds its prompts
    in order (no atomics), so the result is deterministic for a device."""
    import torch

    lists = [list(p) for p in prompt_lists]
    if not lists or not all(lists):
        raise ValueError("a text head needs at least one prompt for every class")
    _check_chunk_size(chunk_size)
    flat = [(c, text) for c, texts in enumerate(lists) for text in texts]
    device = next(clip.parameters()).device
    sums: torch.Tensor | None = None
    out_dtype = torch.float32
    with torch.no_grad():
        for i0 in range(0, len(flat), chunk_size):
            part = flat[i0 : i0 + chunk_size]
            feats = encode_text_cut(clip, tokenizer([t for _, t in part]).to(device))
            feats = feats / feats.norm(dim=-1, keepdim=True)
            if sums is None:
                sums = torch.zeros(len(lists), feats.shape[1], device=device)
                out_dtype = feats.dtype
            start = 0
            for c, run in itertools.groupby(part, key=lambda item: item[0]):  # class by class
                end = start + len(list(run))
                sums[c] += feats[start:end].float().sum(dim=0)
                start = end
        assert sums is not None
        counts = torch.tensor([len(p) for p in lists], device=device, dtype=torch.float32)
        mean = sums / counts[:, None]
        return (mean / mean.norm(dim=-1, keepdim=True)).to(out_dtype)


def _pool_positions(clip: nn.Module, tokens: torch.Tensor) -> torch.Tensor | None:
    """Where open_clip's text pooling reads each sequence (its end token), or None when
    the tower pools otherwise (the cut below then does not apply)."""
    pool = getattr(clip, "text_pool_type", None)
    if pool == "argmax":
        return tokens.argmax(dim=-1)
    eos = getattr(clip, "text_eos_id", None)
    if pool == "eos" and eos is not None:
        return (tokens == eos).int().argmax(dim=-1)
    return None


def encode_text_cut(clip: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """``clip.encode_text(tokens)`` with the sequences cut after the longest prompt's end
    token: open_clip's text transformer is causal and pools at the end token, so the
    padding after it never reaches the features. ImageNet prompts are ~10-20 of the 77
    tokens, so this is several times cheaper; the values equal the full forward up to
    float32 summation order (masked keys add exact zeros;
    tests/test_text_head_chunking_and_cache.py). Towers that are not a standard causal
    open_clip text transformer use ``encode_text`` as is."""
    import torch
    from torch import nn

    needed = ("token_embedding", "positional_embedding", "transformer", "ln_final", "attn_mask")
    positions = _pool_positions(clip, tokens) if all(hasattr(clip, a) for a in needed) else None
    mask = getattr(clip, "attn_mask", None)
    if positions is None or mask is None or tokens.dim() != 2:
        return clip.encode_text(tokens)
    length = int(positions.max()) + 1
    if length >= tokens.shape[1]:
        return clip.encode_text(tokens)
    cast = clip.transformer.get_cast_dtype()
    x = clip.token_embedding(tokens[:, :length]).to(cast)
    x = x + clip.positional_embedding[:length].to(cast)
    x = clip.transformer(x, attn_mask=mask[:length, :length])
    x = clip.ln_final(x)
    x = x[torch.arange(x.shape[0], device=x.device), positions]
    proj = clip.text_projection
    if proj is not None:
        x = proj(x) if isinstance(proj, nn.Linear) else x @ proj
    return x


# -- the key ---------------------------------------------------------------------------
#: module -> (fingerprint of its text tensors, their SHA-256)
_TEXT_HASHES: weakref.WeakKeyDictionary[Any, tuple[tuple, str]] = weakref.WeakKeyDictionary()


def _text_tensors(clip: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [
        (name, t)
        for name, t in clip.state_dict(keep_vars=True).items()
        if not name.startswith("visual.") and name not in _NOT_TEXT
    ]


def text_state_sha256(clip: nn.Module) -> str:
    """SHA-256 of the text side of ``clip``'s state (every tensor outside ``visual.*`` and
    the logit scale/bias: name, dtype, shape and bytes, in ``state_dict`` order).

    Memoised per module: recomputed when any of those tensors was replaced or modified in
    place through autograd-visible ops (an optimiser step, ``load_state_dict``, an in-place
    op under ``no_grad``: each bumps the tensor's version counter). Writes through
    ``tensor.data`` bypass version counters; a caller doing that must not rely on the memo."""
    tensors = _text_tensors(clip)
    fingerprint = tuple(
        (name, t.data_ptr(), t._version, tuple(t.shape), str(t.dtype), str(t.device))
        for name, t in tensors
    )
    memo = _TEXT_HASHES.get(clip)
    if memo is not None and memo[0] == fingerprint:
        return memo[1]
    digest = tensors_sha256(tensors)
    _TEXT_HASHES[clip] = (fingerprint, digest)
    return digest


def tensors_sha256(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 of named tensors, in order: names, dtypes, shapes and bytes (read in place)."""
    import torch

    h = hashlib.sha256()
    for name, tensor in named:
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)};".encode())
        if t.numel():  # reshape: a 0-d tensor has no byte view
            h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def tokenizer_identity(
    tokenizer: Callable[[Sequence[str]], torch.Tensor],
    classnames: Sequence[str],
    templates: Sequence[str],
) -> dict[str, Any]:
    """What identifies the tokenizer for these prompts: its type, context length, a hash of
    its vocabulary (open_clip's ``SimpleTokenizer.encoder``, a HF tokenizer's vocab) when it
    has one, and a hash of the tokens of every class name under the first template and of
    the first class name under every template (every word the prompts contain)."""
    import torch

    cls = type(tokenizer)
    probe = [templates[0].format(c) for c in classnames] + [
        t.format(classnames[0]) for t in templates
    ]
    with warnings.catch_warnings():  # its warnings come again when the head is encoded
        warnings.simplefilter("ignore")
        tokens = tokenizer(probe)
    tokens = torch.as_tensor(tokens).detach().cpu().contiguous()
    return {
        "type": f"{cls.__module__}.{cls.__qualname__}",
        "context_length": getattr(tokenizer, "context_length", None),
        "vocab_sha256": _vocab_sha256(tokenizer),
        "probe_tokens_sha256": hashlib.sha256(
            f"{tokens.dtype}|{tuple(tokens.shape)};".encode()
            + tokens.reshape(-1).view(torch.uint8).numpy().tobytes()
        ).hexdigest(),
    }


#: id of a tokenizer's ``encoder`` dict -> (the dict, held so that its id names it; its size;
#: its SHA-256), the last few: each bundle's tokenizer may wrap one shared tokenizer.
_VOCAB_HASHES: dict[int, tuple[dict[Any, Any], int, str]] = {}


def _vocab_sha256(tokenizer: Any) -> str | None:
    """SHA-256 of the tokenizer's vocabulary (``encoder``, or a wrapped HF tokenizer's
    ``get_vocab()``), None when it exposes none; memoised per ``encoder`` dict (~0.02-0.1 s
    for CLIP's 49,408 entries, and methods build several heads per cell)."""
    vocab = getattr(tokenizer, "encoder", None)
    encoder = isinstance(vocab, dict)
    if not encoder:
        get_vocab = getattr(getattr(tokenizer, "tokenizer", None), "get_vocab", None)
        vocab = get_vocab() if callable(get_vocab) else None
    if not isinstance(vocab, dict):
        return None
    held = _VOCAB_HASHES.get(id(vocab))
    if held is not None and held[0] is vocab and held[1] == len(vocab):
        return held[2]
    blob = json.dumps(sorted(vocab.items(), key=lambda kv: str(kv[0])), default=str)
    digest = hashlib.sha256(blob.encode()).hexdigest()
    if encoder:  # (a get_vocab() dict is a new one at each call)
        _VOCAB_HASHES.pop(id(vocab), None)
        _VOCAB_HASHES[id(vocab)] = (vocab, len(vocab), digest)
        while len(_VOCAB_HASHES) > 8:
            del _VOCAB_HASHES[next(iter(_VOCAB_HASHES))]
    return digest


def _compute_identity(clip: nn.Module, chunk_size: int) -> dict[str, Any]:
    import torch

    param = next(clip.parameters())
    device = param.device
    if device.type == "cuda":
        kind = f"cuda:{torch.cuda.get_device_name(device)}"
    elif device.type == "cpu":
        kind = f"cpu:{torch.backends.cpu.get_cpu_capability()}"
    else:
        kind = device.type
    return {
        "device": kind,
        "torch": torch.__version__,
        "dtype": str(param.dtype).removeprefix("torch."),
        "chunk_size": int(chunk_size),
    }


def head_key(
    clip: nn.Module,
    tokenizer: Callable[[Sequence[str]], torch.Tensor],
    classnames: Sequence[str],
    templates: Sequence[str],
    *,
    chunk_size: int = DEFAULT_CHUNK_PROMPTS,
    class_prompts: dict[str, Sequence[str]] | None = None,
) -> dict[str, Any]:
    """Everything a head's values depend on (see the module docstring); JSON-serialisable.
    ``class_prompts`` (per-class sentences) are part of it only when given, so the keys of
    template heads are those from before sentences existed."""
    key = {
        "recipe": RECIPE_VERSION,
        "text_state_sha256": text_state_sha256(clip),
        "text_tower": {
            "type": f"{type(clip).__module__}.{type(clip).__qualname__}",
            "pool_type": _plain(getattr(clip, "text_pool_type", None)),
            "eos_id": _plain(getattr(clip, "text_eos_id", None)),
        },
        "classnames": [str(c) for c in classnames],
        "templates": [str(t) for t in templates],
        "tokenizer": tokenizer_identity(tokenizer, classnames, list(templates) or ["{}"]),
        "compute": _compute_identity(clip, chunk_size),
    }
    if class_prompts is not None:
        key["class_prompts"] = {str(c): [str(t) for t in class_prompts[c]] for c in classnames}
    return key


def _plain(value: Any) -> Any:
    return value if value is None or isinstance(value, (bool, int, float, str)) else repr(value)


def key_digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


# -- the cache ---------------------------------------------------------------------------
def cache_enabled() -> bool:
    """False when ``$TTA_BENCH_TEXT_CACHE`` is ``0``, ``off``, ``false`` or ``no``."""
    return os.environ.get(CACHE_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def text_head_dir() -> Path:
    """Where cached heads live: ``cache_dir()/text-heads``."""
    return cache_dir() / "text-heads"


def entry_path(key: dict[str, Any]) -> Path:
    """The cache file of the head with ``key`` (``head_key``); it may not exist."""
    return text_head_dir() / f"{key_digest(key)[:40]}{_SUFFIX}"


def class_embeddings(
    clip: nn.Module,
    tokenizer: Callable[[Sequence[str]], torch.Tensor],
    classnames: Sequence[str],
    templates: Sequence[str],
    *,
    chunk_size: int = DEFAULT_CHUNK_PROMPTS,
    cache: bool = True,
    about: dict[str, Any] | None = None,
    class_prompts: dict[str, Sequence[str]] | None = None,
) -> torch.Tensor:
    """``encode_class_embeddings(...)`` through the on-disk cache (when ``cache`` and
    ``cache_enabled()``), on ``clip``'s device; with ``class_prompts`` (per-class sentences,
    ``tta_bench.prompts``), ``encode_prompt_lists`` of each class's formatted templates (none
    or more) and sentences. ``about`` (e.g. model name and weights) is stored beside the key
    for ``text_head_entries``; it is not part of the key."""
    classnames, templates = list(classnames), list(templates)

    def compute() -> torch.Tensor:
        if class_prompts is not None:
            lists = class_prompt_lists(classnames, templates, class_prompts)
            return encode_prompt_lists(clip, tokenizer, lists, chunk_size=chunk_size)
        return encode_class_embeddings(
            clip, tokenizer, classnames, templates, chunk_size=chunk_size
        )

    if not (cache and cache_enabled()):
        return compute()
    from filelock import FileLock

    device = next(clip.parameters()).device
    key = head_key(
        clip, tokenizer, classnames, templates, chunk_size=chunk_size, class_prompts=class_prompts
    )
    try:
        path = entry_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # no usable cache directory: the head is still computed
        warnings.warn(f"text heads are not cached ({exc})", stacklevel=2)
        return compute()
    found = _read_entry(path, key)
    if found is not None:
        return found.to(device)
    lock: FileLock | None = FileLock(f"{path}.lock", timeout=LOCK_TIMEOUT_S)
    try:
        lock.acquire()
    except OSError:  # a stuck holder (filelock.Timeout) or no lock file: go on unlocked
        lock = None
    try:
        found = _read_entry(path, key)  # written while this process waited
        if found is not None:
            return found.to(device)
        result = compute()
        meta = {"about": about or {}, "classes": len(classnames), "templates": len(templates)}
        try:
            _write_entry(path, key, result, meta)
        except OSError as exc:
            warnings.warn(f"text head not cached at {path} ({exc})", stacklevel=2)
        return result
    finally:
        if lock is not None:
            lock.release()


def _tensor_bytes(t: torch.Tensor) -> bytes:
    import torch

    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _write_entry(path: Path, key: dict[str, Any], emb: torch.Tensor, meta: dict[str, Any]) -> None:
    """One file: magic, 8-byte header length, JSON header (key, shape, dtype, payload
    SHA-256, metadata), raw little-endian payload. Written atomically."""
    dtype = str(emb.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise ValueError(f"cannot cache a text head of dtype {emb.dtype}; supported: {_DTYPES}")
    payload = _tensor_bytes(emb)
    header = {
        "format": _FORMAT,
        "key": key,
        "shape": list(emb.shape),
        "dtype": dtype,
        "payload_sha256": hashlib.sha256(payload).hexdigest(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **meta,
    }
    blob = json.dumps(header, sort_keys=True).encode()
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        fh.write(_MAGIC + struct.pack("<Q", len(blob)) + blob + payload)


def _read_header(data: bytes) -> tuple[dict[str, Any], bytes]:
    """Header and payload of an entry's bytes; ``ValueError`` saying what is wrong."""
    if not data.startswith(_MAGIC):
        raise ValueError("not a text-head file (bad magic)")
    start = len(_MAGIC) + 8
    if len(data) < start:
        raise ValueError("truncated header")
    (n,) = struct.unpack("<Q", data[len(_MAGIC) : start])
    if len(data) < start + n:
        raise ValueError("truncated header")
    try:
        header = json.loads(data[start : start + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"unreadable header ({exc})") from None
    if not isinstance(header, dict) or header.get("format") != _FORMAT:
        raise ValueError(
            f"unknown format {header.get('format') if isinstance(header, dict) else header!r}"
        )
    return header, data[start + n :]


def _read_entry(path: Path, key: dict[str, Any]) -> torch.Tensor | None:
    """The cached head at ``path`` when it is whole and holds ``key``; None when there is
    none; a warning and None when it is corrupt (it is then recomputed and overwritten)."""
    import torch

    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        warnings.warn(f"text-head cache entry {path} is unreadable ({exc})", stacklevel=3)
        return None
    try:
        header, payload = _read_header(data)
        if header.get("key") != key:
            raise ValueError("its key differs from the requested head's")
        shape, dtype = header.get("shape"), header.get("dtype")
        if (
            not isinstance(shape, list)
            or len(shape) != 2
            or shape[0] != len(key["classnames"])
            or dtype not in _DTYPES
        ):
            raise ValueError(f"bad shape/dtype {shape!r}/{dtype!r}")
        tdtype = getattr(torch, dtype)
        if len(payload) != shape[0] * shape[1] * torch.empty((), dtype=tdtype).element_size():
            raise ValueError(f"payload of {len(payload)} bytes does not hold {shape} {dtype}")
        if hashlib.sha256(payload).hexdigest() != header.get("payload_sha256"):
            raise ValueError("payload checksum mismatch")
    except (ValueError, OSError, struct.error) as exc:
        warnings.warn(
            f"text-head cache entry {path} is corrupt ({exc}); recomputing it", stacklevel=3
        )
        return None
    flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return flat.view(tdtype).view(shape[0], shape[1])


# -- listing and clearing (no torch) -----------------------------------------------------
def text_head_entries() -> list[dict[str, Any]]:
    """Cached heads, largest first: ``{path, bytes, classes, templates, about, created,
    device, ok}`` (``ok`` False for a file whose header does not parse)."""
    folder = text_head_dir()
    out = []
    for path in sorted(folder.glob(f"*{_SUFFIX}")) if folder.exists() else []:
        entry: dict[str, Any] = {"path": str(path), "bytes": path.stat().st_size, "ok": False}
        try:
            with open(path, "rb") as fh:
                head = fh.read(len(_MAGIC) + 8)
                if head.startswith(_MAGIC) and len(head) == len(_MAGIC) + 8:
                    (n,) = struct.unpack("<Q", head[len(_MAGIC) :])
                    header, _ = _read_header(head + fh.read(n))
                    entry.update(
                        ok=True,
                        classes=header.get("classes"),
                        templates=header.get("templates"),
                        about=header.get("about", {}),
                        created=header.get("created"),
                        device=header.get("key", {}).get("compute", {}).get("device"),
                    )
        except (OSError, ValueError, struct.error):
            pass
        out.append(entry)
    return sorted(out, key=lambda e: -e["bytes"])


def clear_text_heads() -> list[dict[str, Any]]:
    """Remove every cached head (and its lock file); returns what was removed."""
    removed = text_head_entries()
    for e in removed:
        Path(e["path"]).unlink(missing_ok=True)
    folder = text_head_dir()
    for lock in folder.glob(f"*{_SUFFIX}.lock") if folder.exists() else []:
        lock.unlink(missing_ok=True)
    return removed
