"""Any open_clip architecture as a ``ModelBundle``: a pretrained tag (from the local
open_clip / HF cache: nothing is downloaded where there is no network), a local checkpoint
file, or random weights only when asked for (``allow_random=True``: tests and cost
benchmarks; a suite never evaluates random weights by omission).

Preprocessing (input size, mean, std) is read from the model's own open_clip config, never
guessed; the tokenizer is ``open_clip.get_tokenizer(arch)``: the bundled BPE vocabulary for
the CLIP architectures (no download), or, for an architecture whose config names a Hugging
Face tokenizer or text tower (SigLIP, SigLIP2, CLIPA, the multilingual ones), Hugging Face
``transformers`` (the ``hf-text`` extra) with that repository's files in the local HF cache:
``check_args`` refuses, before anything is built, where either is missing.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import sys
from pathlib import Path

from tta_bench.model import ModelBundle, Preprocess

__all__ = ["openclip", "check_args", "hf_text_files", "ModelUnavailableError", "HF_TEXT_EXTRA"]

#: The optional extra of this distribution that installs what open_clip's Hugging Face
#: tokenizers and text towers import.
HF_TEXT_EXTRA = "hf-text"


class ModelUnavailableError(FileNotFoundError, ValueError):
    """Weights that are neither cached nor a readable file (a ValueError: CLI exit 2)."""


def _checkpoint_id(path: Path) -> str:
    """Name + size + hash of the first MiB: identifies a checkpoint without reading GBs."""
    with open(path, "rb") as fh:
        head = hashlib.sha256(fh.read(1 << 20)).hexdigest()[:12]
    return f"checkpoint:{path.name}:{path.stat().st_size}:{head}"


def hf_text_files(arch: str) -> dict[str, list[str]]:
    """The Hugging Face files ``arch``'s text side reads, ``{repo id: [file, ...]}``: the
    tokenizer's ``tokenizer_config.json`` (the file ``AutoTokenizer`` reads first; the
    vocabulary files sit beside it) for a config naming ``hf_tokenizer_name``, and the text
    tower's ``config.json`` for one naming ``hf_model_name``; empty for the architectures
    with open_clip's built-in tokenizer and text transformer."""
    import open_clip

    text_cfg = (open_clip.get_model_config(arch) or {}).get("text_cfg", {})
    files: dict[str, list[str]] = {}
    for key, name in (
        ("hf_tokenizer_name", "tokenizer_config.json"),
        ("hf_model_name", "config.json"),
    ):
        if text_cfg.get(key):
            files.setdefault(text_cfg[key], []).append(name)
    return files


def _importable(module: str) -> bool:
    """Whether ``import module`` would find it, without importing it (``sys.modules`` first:
    a module blocked there with None is not importable)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def _hf_text_help(arch: str, files: dict[str, list[str]]) -> str:
    """What a Hugging Face text side needs, said to the user: the extra and the files."""
    wanted = "; ".join(f"{repo}: {', '.join(names)}" for repo, names in files.items())
    return (
        f"It needs the {HF_TEXT_EXTRA} extra (pip install 'mura-plugin[{HF_TEXT_EXTRA}]': "
        "Hugging Face transformers) and these files, with the vocabulary files beside them, "
        f"in the local HF cache (HF_HUB_CACHE, default ~/.cache/huggingface/hub): {wanted}. "
        "Nothing is downloaded at run time: on a machine with network, run "
        f"python -c \"import open_clip; open_clip.get_tokenizer('{arch}')\" once "
        "(or huggingface-cli download <repo>) and copy the cache"
    )


def _check_hf_text(arch: str) -> None:
    """ValueError where ``arch``'s Hugging Face text side cannot load here: ``transformers``
    not importable, or a file of ``hf_text_files(arch)`` not in the local HF cache."""
    files = hf_text_files(arch)
    if not files:
        return
    if not _importable("transformers"):
        raise ModelUnavailableError(
            f"openclip {arch}: its text side is Hugging Face's ({', '.join(files)}) and the "
            f"transformers package is not installed here. {_hf_text_help(arch, files)}"
        )
    from huggingface_hub import try_to_load_from_cache

    missing = {
        repo: [name for name in names if not isinstance(try_to_load_from_cache(repo, name), str)]
        for repo, names in files.items()
    }
    missing = {repo: names for repo, names in missing.items() if names}
    if missing:
        raise ModelUnavailableError(
            f"openclip {arch}: the Hugging Face files of its text side are not in the local HF "
            f"cache. {_hf_text_help(arch, missing)}"
        )


def _tokenizer(arch: str):
    """``open_clip.get_tokenizer(arch)``; where a Hugging Face tokenizer that passed
    ``check_args`` still does not load (a file beside its config missing), a
    ``ModelUnavailableError`` saying what it needs."""
    import open_clip

    files = hf_text_files(arch)
    try:
        return open_clip.get_tokenizer(arch)
    except Exception as exc:
        if not files:
            raise
        raise ModelUnavailableError(
            f"openclip {arch}: its Hugging Face tokenizer does not load "
            f"({type(exc).__name__}: {exc}). {_hf_text_help(arch, files)}"
        ) from exc


def check_args(
    *,
    arch: str = "ViT-B-32",
    pretrained: str | None = None,
    checkpoint: str | None = None,
    image_size: int | None = None,
    allow_random: bool = False,
) -> None:
    """Validate ``openclip``'s arguments without building the model (the CLI calls it
    before any setup): the architecture is one of ``open_clip.list_models()``, the tag one
    of its pretrained tags, the checkpoint an existing file (not read), without either
    ``allow_random`` is set, and a Hugging Face text side (``hf_text_files``) has
    ``transformers`` and its files in the local HF cache. Raises ``ValueError``
    (``ModelUnavailableError`` for a missing checkpoint file or HF text side), exactly as
    ``openclip`` would."""
    import open_clip

    archs = open_clip.list_models()
    if arch not in archs:
        close = difflib.get_close_matches(arch, archs, n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise ValueError(
            f"unknown open_clip architecture {arch!r}; {hint}see open_clip.list_models()"
        )
    if pretrained and checkpoint:
        raise ValueError("give either pretrained (a tag) or checkpoint (a file), not both")
    if image_size is not None and (pretrained or checkpoint):
        raise ValueError("image_size can only be overridden for random weights (pretrained=None)")
    tags = open_clip.list_pretrained_tags_by_model(arch)
    if pretrained and pretrained not in tags:
        raise ValueError(
            f"unknown pretrained tag {pretrained!r} for {arch}; available: {', '.join(tags)}"
        )
    if checkpoint and not Path(checkpoint).expanduser().is_file():
        raise ModelUnavailableError(
            f"checkpoint file {str(Path(checkpoint).expanduser())!r} does not exist"
        )
    if not (pretrained or checkpoint or allow_random):
        shown = ", ".join(tags[:4]) + (", ..." if len(tags) > 4 else "")
        raise ValueError(
            f"openclip {arch}: no weights given, so it would evaluate a randomly initialised "
            f"model. Pass model.pretrained=<tag> (for {arch}: {shown or 'no published tags'}; "
            "the weights must be in the local open_clip/HF cache), "
            "model.checkpoint=<file> (a local state dict), or model.allow_random=true "
            "(random weights, for cost benchmarks only)"
        )
    _check_hf_text(arch)


def openclip(
    *,
    arch: str = "ViT-B-32",
    pretrained: str | None = None,
    checkpoint: str | None = None,
    image_size: int | None = None,
    allow_random: bool = False,
) -> ModelBundle:
    """Build ``arch`` with weights from ``pretrained`` (an open_clip tag, e.g. ``openai``)
    or ``checkpoint`` (a local ``.pt``/``.bin``/``.safetensors`` state dict); with neither,
    random initialisation (seeded by the caller's torch seed) only if ``allow_random``
    (cost benchmarks, tests): a benchmark on random weights is otherwise an error.
    ``image_size`` overrides the input size of the architecture (random weights only:
    pretrained position embeddings are trained for the configured size). Arguments are
    checked first by ``check_args``."""
    import open_clip

    check_args(
        arch=arch,
        pretrained=pretrained,
        checkpoint=checkpoint,
        image_size=image_size,
        allow_random=allow_random,
    )
    tokenizer = _tokenizer(arch)  # before the model: seconds saved when it cannot load
    weights = "random-init"
    source: str | None = None
    if pretrained:
        source, weights = pretrained, f"open_clip:{arch}:{pretrained}"
    elif checkpoint:
        path = Path(checkpoint).expanduser()
        source, weights = str(path), _checkpoint_id(path)
    try:
        model, _, _ = open_clip.create_model_and_transforms(
            arch, pretrained=source, force_image_size=image_size
        )
    except Exception as exc:
        if checkpoint:
            raise ValueError(
                f"checkpoint {source!r} does not load into open_clip {arch} "
                f"({type(exc).__name__}: {exc}); is model.arch the checkpoint's architecture?"
            ) from exc
        if not pretrained:
            raise
        raise ModelUnavailableError(
            f"open_clip weights {arch}/{pretrained} are not in the local cache and cannot be "
            f"downloaded here ({type(exc).__name__}: {exc}). On a machine with network, run "
            f"open_clip.create_model_and_transforms({arch!r}, pretrained={pretrained!r}) once to "
            "fill the HF cache, or download the checkpoint file and pass "
            f"model.checkpoint=/path/to/weights (with model.arch={arch})"
        ) from exc
    model.eval()
    cfg = open_clip.get_model_preprocess_cfg(model)
    size = cfg["size"]
    size = size if isinstance(size, int) else size[0]
    if not isinstance(cfg["size"], int) and len(set(cfg["size"])) != 1:
        raise ValueError(f"{arch}: non-square input size {cfg['size']} is not supported")
    return ModelBundle(
        clip=model,
        tokenizer=tokenizer,
        preprocess=Preprocess(image_size=int(size), mean=tuple(cfg["mean"]), std=tuple(cfg["std"])),
        name=f"openclip:{arch}",
        weights=weights,
    )


#: The CLI's cheap pre-setup check (``factory.check_args(**model_args)``).
openclip.check_args = check_args  # type: ignore[attr-defined]
