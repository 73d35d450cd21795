"""The embedded default model: a tiny open_clip dual encoder that this project pretrained
itself on the clean digits train split, shipped with the package as a safetensors file
(``weights/tiny-clip-digits.safetensors``, ~4 MB), so every machine evaluates the same
weights; its SHA-256 is recorded in every result.

Why shipped rather than trained on first use: training is deterministic for a given
machine and thread count only (1 vs 2 threads, or AVX-512 vs AVX2 kernels, give different
weights after one epoch), so "the same recipe" was not the same model everywhere.

The file stores every parameter except the untrained rows of the 49,408-token embedding
table: only the rows of tokens that occur in the pretraining prompts (the digits class
names x templates, plus the start, end and padding tokens) were ever trained, and only those
are stored; the other rows are zeros when loaded. A prompt with tokens outside that
vocabulary is warned about (``ShippedTokenizer``): the model has never seen them.

Reproduce the file (single thread, fixed seed, ~1 minute on one core)::

    python -m mura_plugin.models.tiny_clip pretrain [--out PATH]

It prints the SHA-256 of what it produced and whether that equals the shipped file's.
Float kernels differ between CPU instruction sets (AVX-512 vs AVX2), so another CPU can
produce other weights; the shipped file is the reference.

Recipe: ViT (patch 8 at 32 px, 4 blocks, width 128) + a 2-layer text transformer, trained
with the CLIP objective restricted to class-name prompts (image features against the text
embeddings of all ten classes under a randomly drawn template, cross-entropy), AdamW with
cosine decay, light translation augmentation. Clean zero-shot test accuracy is ~98%.
"""

from __future__ import annotations

import argparse
import copy
import functools
import hashlib
import json
import sys
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tta_bench.catalog import entry
from tta_bench.model import ModelBundle, Preprocess, format_prompts
from tta_bench.paths import atomic_path, file_sha256

__all__ = [
    "TinyClipRecipe",
    "tiny_clip_digits",
    "build_tiny_clip",
    "pretrain",
    "load_shipped",
    "save_shippable",
    "SHIPPED_WEIGHTS",
]

#: The shipped weights (produced by ``pretrain(TinyClipRecipe())`` on one thread).
SHIPPED_WEIGHTS = Path(__file__).with_name("weights") / "tiny-clip-digits.safetensors"
#: Name of the stored embedding rows and of their token ids in the file.
_ROWS, _ROW_IDS = "token_embedding.rows", "token_embedding.row_ids"
_INFO = "tiny-clip-digits"

MEAN = (0.5, 0.5, 0.5)
STD = (0.5, 0.5, 0.5)
CONTEXT_LENGTH = 16


@dataclass(frozen=True)
class TinyClipRecipe:
    image_size: int = 32
    patch_size: int = 8
    vision_layers: int = 4
    vision_width: int = 128
    text_layers: int = 2
    text_width: int = 64
    embed_dim: int = 64
    epochs: int = 30
    batch_size: int = 64
    lr: float = 2e-3
    weight_decay: float = 0.05
    max_translate: int = 3
    seed: int = 0
    version: int = 1  # bump when the training code changes what it produces

    def fingerprint(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@functools.cache
def tokenizer():
    """open_clip's tokenizer at the tiny model's context length. It is stateless (its cache
    memoises a pure function), so one per process serves every bundle built instead of a
    build of its BPE tables per model build."""
    from open_clip.tokenizer import SimpleTokenizer

    return SimpleTokenizer(context_length=CONTEXT_LENGTH)


def build_tiny_clip(recipe: TinyClipRecipe) -> torch.nn.Module:
    from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg

    vision = CLIPVisionCfg(
        layers=recipe.vision_layers,
        width=recipe.vision_width,
        head_width=32,
        patch_size=recipe.patch_size,
        image_size=recipe.image_size,
    )
    text = CLIPTextCfg(
        context_length=CONTEXT_LENGTH,
        width=recipe.text_width,
        heads=max(1, recipe.text_width // 32),
        layers=recipe.text_layers,
    )
    return CLIP(embed_dim=recipe.embed_dim, vision_cfg=vision, text_cfg=text)


def _translate(x: torch.Tensor, max_shift: int, gen: torch.Generator) -> torch.Tensor:
    """Random integer translations with zero padding (digits sit on a black background)."""
    if max_shift == 0:
        return x
    b, c, h, w = x.shape
    pad = F.pad(x, (max_shift,) * 4)
    dx = torch.randint(0, 2 * max_shift + 1, (b,), generator=gen)
    dy = torch.randint(0, 2 * max_shift + 1, (b,), generator=gen)
    rows = (dy[:, None] + torch.arange(h)[None])[:, None, :, None]
    cols = (dx[:, None] + torch.arange(w)[None])[:, None, None, :]
    return pad[
        torch.arange(b)[:, None, None, None], torch.arange(c)[None, :, None, None], rows, cols
    ]


def pretrain(recipe: TinyClipRecipe, progress: bool = True) -> torch.nn.Module:
    """Train the tiny CLIP on the digits train split; deterministic for a recipe."""
    from tqdm.auto import tqdm

    from mura_plugin.datasets.digits import digits_arrays

    meta = entry("datasets", "digits")
    classnames, templates = list(meta["classnames"]), list(meta["templates"])
    torch.manual_seed(recipe.seed)
    gen = torch.Generator().manual_seed(recipe.seed)
    model = build_tiny_clip(recipe)
    tok = tokenizer()
    tokens = tok(format_prompts(classnames, templates)).view(len(classnames), len(templates), -1)
    images, labels = digits_arrays("train")
    x_all = torch.from_numpy(images).permute(0, 3, 1, 2).float().div(255.0)
    x_all = (x_all - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    y_all = torch.from_numpy(labels)
    steps_per_epoch = (len(x_all) + recipe.batch_size - 1) // recipe.batch_size
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=recipe.lr, total_steps=recipe.epochs * steps_per_epoch, pct_start=0.1
    )
    model.train()
    bar = tqdm(
        range(recipe.epochs),
        desc="pretraining tiny-clip-digits",
        unit="epoch",
        disable=not progress,
    )
    for _ in bar:
        perm = torch.randperm(len(x_all), generator=gen)
        for s in range(steps_per_epoch):
            idx = perm[s * recipe.batch_size : (s + 1) * recipe.batch_size]
            x = _translate(x_all[idx], recipe.max_translate, gen)
            # One random template per class and step: the text tower sees every template.
            pick = torch.randint(0, len(templates), (len(classnames),), generator=gen)
            text = tokens[torch.arange(len(classnames)), pick]
            img_f = F.normalize(model.encode_image(x), dim=-1)
            txt_f = F.normalize(model.encode_text(text), dim=-1)
            logits = model.logit_scale.exp() * img_f @ txt_f.t()
            loss = F.cross_entropy(logits, y_all[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            with torch.no_grad():
                model.logit_scale.clamp_(0, 4.6052)
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    return model


def trained_token_ids(tok=None) -> list[int]:
    """Token ids whose embedding rows pretraining updates: those of the digits prompts,
    plus the start/end-of-text and padding tokens."""
    meta = entry("datasets", "digits")
    tok = tok or tokenizer()
    tokens = tok(format_prompts(list(meta["classnames"]), list(meta["templates"])))
    ids = set(int(t) for t in tokens.unique())
    ids |= {tok.sot_token_id, tok.eot_token_id, 0}
    return sorted(ids)


def save_shippable(model: torch.nn.Module, path: str | Path, recipe: TinyClipRecipe) -> str:
    """Write ``model`` as the shipped safetensors file (every tensor but the untrained
    embedding rows); returns the file's SHA-256."""
    from safetensors.torch import save_file

    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    table = state.pop("token_embedding.weight")
    ids = torch.tensor(trained_token_ids(), dtype=torch.int64)
    state[_ROWS] = table[ids].contiguous()
    state[_ROW_IDS] = ids
    # One metadata key: safetensors writes a several-key metadata map in hash order, so
    # identical weights would not give identical bytes (and file hash).
    info = {"format": "tiny-clip-digits/1", "recipe": asdict(recipe), "vocab_size": table.shape[0]}
    metadata = {_INFO: json.dumps(info, sort_keys=True)}
    with atomic_path(path) as tmp:
        save_file(state, str(tmp), metadata=metadata)
    return file_sha256(path)


def load_shipped(path: str | Path = SHIPPED_WEIGHTS) -> tuple[torch.nn.Module, TinyClipRecipe]:
    """The model stored at ``path`` (default: the shipped file) and its recipe."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"tiny-clip-digits weights {str(path)!r} are missing: the mura-plugin "
            "installation is incomplete (reinstall it), or rebuild them with "
            "`python -m mura_plugin.models.tiny_clip pretrain`"
        )
    with safe_open(str(path), framework="pt") as fh:
        info = json.loads((fh.metadata() or {})[_INFO])
    recipe = TinyClipRecipe(**info["recipe"])
    state = load_file(str(path))
    rows, ids = state.pop(_ROWS), state.pop(_ROW_IDS)
    table = torch.zeros(int(info["vocab_size"]), rows.shape[1], dtype=rows.dtype)
    table[ids] = rows
    state["token_embedding.weight"] = table
    model = build_tiny_clip(recipe)
    model.load_state_dict(state, strict=True)
    model.eval()
    return model, recipe


class ShippedTokenizer:
    """open_clip's tokenizer that warns, once per prompt set, when prompts use tokens the
    shipped model was never trained on (their embedding rows are zeros)."""

    def __init__(self, known: set[int]):
        self._tok = tokenizer()
        self._known = known
        self.sot_token_id = self._tok.sot_token_id
        self.eot_token_id = self._tok.eot_token_id
        self.context_length = self._tok.context_length

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text)

    def decode(self, ids) -> str:
        return self._tok.decode(ids)

    def __getattr__(self, name: str):
        # Only called for attributes this wrapper lacks; private and dunder names (copy,
        # pickle protocols before __init__ ran) must not recurse into self._tok.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._tok, name)

    def __call__(self, texts, context_length: int | None = None) -> torch.Tensor:
        out = self._tok(texts, context_length) if context_length else self._tok(texts)
        unknown = sorted(set(int(t) for t in out.unique()) - self._known)
        if unknown:
            words = ", ".join(repr(self._tok.decode([t]).strip()) for t in unknown[:8])
            warnings.warn(
                f"tiny-clip-digits was pretrained on the digits prompts only; these prompts "
                f"use {len(unknown)} untrained token(s) ({words}), whose embeddings are zeros",
                stacklevel=2,
            )
        return out


def tiny_clip_digits() -> ModelBundle:
    """The default model, loaded from the shipped weights (no training, no download): a
    copy of its own of the model the file with these contents gives."""
    digest = file_sha256(SHIPPED_WEIGHTS) if SHIPPED_WEIGHTS.is_file() else ""
    model, recipe = _shipped_model(str(SHIPPED_WEIGHTS), digest)
    return ModelBundle(
        clip=copy.deepcopy(model),
        tokenizer=ShippedTokenizer(set(trained_token_ids())),
        preprocess=Preprocess(image_size=recipe.image_size, mean=MEAN, std=STD),
        name="tiny-clip-digits",
        weights=f"shipped:{SHIPPED_WEIGHTS.name}",
        weights_sha256=digest,
    )


@functools.lru_cache(maxsize=2)
def _shipped_model(path: str, sha256: str) -> tuple[torch.nn.Module, TinyClipRecipe]:
    """``load_shipped(path)`` once per process and file contents (``sha256``: a file
    rewritten in place is loaded again). Building the model draws a random initialisation
    of every tensor (the 49,408-row token table most) before the file's values replace it,
    most of a load's time (docs/speed.md); each bundle gets a deep copy of this one, the
    same values in tensors of its own."""
    del sha256  # the cache key
    return load_shipped(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mura_plugin.models.tiny_clip",
        description="Reproduce the shipped tiny-clip-digits weights (one thread, fixed seed).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    pt = sub.add_parser("pretrain", help="pretrain and compare with the shipped file")
    pt.add_argument("--out", default=None, help="where to write (default: a temporary file)")
    pt.add_argument("--epochs", type=int, default=TinyClipRecipe.epochs)
    pt.add_argument("--seed", type=int, default=TinyClipRecipe.seed)
    args = parser.parse_args(argv)
    import tempfile

    torch.set_num_threads(1)  # the shipped file was produced on one thread
    recipe = TinyClipRecipe(epochs=args.epochs, seed=args.seed)
    model = pretrain(recipe)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp()) / SHIPPED_WEIGHTS.name
    digest = save_shippable(model, out, recipe)
    shipped = file_sha256(SHIPPED_WEIGHTS) if SHIPPED_WEIGHTS.is_file() else None
    print(f"wrote {out}\nsha256 {digest}")
    print(f"shipped {shipped}")
    capability = torch.backends.cpu.get_cpu_capability()
    if digest == shipped:
        print("reproduces the shipped weights exactly")
        return 0
    print(
        f"differs from the shipped weights (this CPU's kernels: {capability}; the shipped "
        "file was produced on an AVX512 CPU with one thread)"
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
