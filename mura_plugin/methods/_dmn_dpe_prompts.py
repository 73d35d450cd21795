"""Class heads with LLM-written class descriptions (shared by DMN, DPE and MCP).

DMN's (``--text_prompt tip_cupl``) and DPE's (``clip_classifier``) official heads encode,
per class, its templates *and* its CuPL descriptions (GPT-3 sentences shipped as
``gpt3_prompts/CuPL_prompts_<set>.json``, ``{classname: [sentence, ...]}``) and average
them: the L2-normalised mean of the L2-normalised text features of all of that class's
prompts, template-formatted and description alike. Nothing is shipped or downloaded here:
a method's ``prompts`` config names such a JSON file; None keeps the template-only head.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from mura_plugin.methods._text_heads import check_text_head, class_head
from tta_bench.model import ZeroShotClassifier
from tta_bench.text_head import encode_text_cut

__all__ = ["described_head", "load_descriptions", "method_head"]


def load_descriptions(path: str | Path, classnames: Sequence[str]) -> list[list[str]]:
    """The descriptions of every class of ``classnames`` from the JSON file ``path``
    (``{classname: [description, ...]}``). A class is looked up by its name, else by its
    name with underscores as spaces (the official code's ``replace('_', ' ')``); a class
    the file lacks is an error, extra keys are ignored."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"prompts file not found: {file}")
    data = json.loads(file.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object {{classname: [description, ...]}}")
    out, missing = [], []
    for name in classnames:
        key = name if name in data else name.replace("_", " ")
        if key not in data:
            missing.append(name)
            continue
        texts = data[key]
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise ValueError(f"{file}: the descriptions of {name!r} must be a list of strings")
        out.append(list(texts))
    if missing:
        shown = ", ".join(repr(m) for m in missing[:5])
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"{file}: no descriptions for class(es) {shown}{more}")
    return out


@torch.no_grad()
def described_head(
    model: ZeroShotClassifier, templates: Sequence[str], descriptions: Sequence[Sequence[str]]
) -> torch.Tensor:
    """Class embeddings ``[C, D]`` (float32, on the model's device): per class, the
    normalised mean of the normalised text features of ``t.format(class)`` for every
    template and of each of its descriptions. Encoded in chunks of at most
    ``model.text_chunk_size`` prompts; the model is not changed."""
    device = model.class_embeddings.device
    chunk = max(1, int(getattr(model, "text_chunk_size", 256)))
    rows = []
    for name, described in zip(model.classnames, descriptions):
        prompts = [t.format(name) for t in templates] + list(described)
        if not prompts:
            raise ValueError(f"class {name!r} has neither templates nor descriptions")
        total = None
        for i in range(0, len(prompts), chunk):
            tokens = model.tokenizer(prompts[i : i + chunk]).to(device)
            feats = encode_text_cut(model.clip, tokens).float()
            part = (feats / feats.norm(dim=-1, keepdim=True)).sum(dim=0)
            total = part if total is None else total + part
        mean = total / len(prompts)
        rows.append(mean / mean.norm())
    return torch.stack(rows).to(device=device, dtype=model.class_embeddings.dtype)


def method_head(
    model: ZeroShotClassifier,
    text_head: str,
    official: Sequence[str],
    prompts: str | None,
) -> torch.Tensor:
    """The head a method classifies with: ``class_head(model, text_head, official)`` when
    ``prompts`` is None; otherwise the templates of that head (the protocol's
    ``model.templates``, or ``official``) together with the descriptions of the JSON file
    ``prompts`` (``described_head``)."""
    if prompts is None:
        return class_head(model, text_head, official)
    check_text_head(text_head)
    if text_head == "protocol" and model.class_prompts is not None:
        raise ValueError(
            "method.prompts adds descriptions to the protocol's templates, but this protocol's "
            "head already has per-class sentences (protocol.text_head); give one or the other"
        )
    templates = list(model.templates) if text_head == "protocol" else list(official)
    return described_head(model, templates, load_descriptions(prompts, model.classnames))
