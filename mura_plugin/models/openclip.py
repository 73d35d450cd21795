"""Any open_clip architecture as a ``ModelBundle``: a pretrained tag (from the local
open_clip / HF cache: nothing is downloaded where there is no network), a local checkpoint
file, or random weights only when asked for (``allow_random=True``: tests and cost
benchmarks; a suite never evaluates random weights by omission).

Preprocessing (input size, mean, std) is read from the model's own open_clip config, never
guessed; the tokenizer is ``open_clip.get_tokenizer(arch)`` (the bundled BPE vocabulary for
the CLIP architectures, no download).
"""

from __future__ import annotations

import difflib
import hashlib
from pathlib import Path

from tta_bench.model import ModelBundle, Preprocess

__all__ = ["openclip", "check_args", "ModelUnavailableError"]


class ModelUnavailableError(FileNotFoundError, ValueError):
    """Weights that are neither cached nor a readable file (a ValueError: CLI exit 2)."""


def _checkpoint_id(path: Path) -> str:
    """Name + size + hash of the first MiB: identifies a checkpoint without reading GBs."""
    with open(path, "rb") as fh:
        head = hashlib.sha256(fh.read(1 << 20)).hexdigest()[:12]
    return f"checkpoint:{path.name}:{path.stat().st_size}:{head}"


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
    of its pretrained tags, the checkpoint an existing file (not read), and without either
    ``allow_random`` is set. Raises ``ValueError`` (``ModelUnavailableError`` for a missing
    checkpoint file), exactly as ``openclip`` would."""
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
        tokenizer=open_clip.get_tokenizer(arch),
        preprocess=Preprocess(image_size=int(size), mean=tuple(cfg["mean"]), std=tuple(cfg["std"])),
        name=f"openclip:{arch}",
        weights=weights,
    )


#: The CLI's cheap pre-setup check (``factory.check_args(**model_args)``).
openclip.check_args = check_args  # type: ignore[attr-defined]
