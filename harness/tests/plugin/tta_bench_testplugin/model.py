"""A tiny CLIP-like dual encoder (about 2,100 parameters) and its deterministic tokenizer.

The image tower pools a 16 px image to 4 x 4, then Linear -> LayerNorm -> tanh -> Linear;
the text tower mean-pools token embeddings, then LayerNorm -> Linear. Weights are drawn
from ``seed`` only, so every process builds the identical model (the same state hash).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tta_bench.model import ModelBundle, Preprocess

IMAGE_SIZE = 16
EMBED_DIM = 8
VOCAB = 64
CONTEXT = 8
#: How many bundles ``tiny_clip`` built in this process (tests: "no model was built").
builds = 0


class TinyTokenizer:
    """Words -> ids ``1..VOCAB-1`` by a stable hash; 0 pads to ``CONTEXT`` tokens."""

    context_length = CONTEXT

    def __call__(self, texts: Sequence[str]) -> torch.Tensor:
        out = torch.zeros(len(texts), CONTEXT, dtype=torch.long)
        for i, text in enumerate(texts):
            ids = [
                1
                + int.from_bytes(hashlib.blake2b(w.encode(), digest_size=4).digest(), "little")
                % (VOCAB - 1)
                for w in text.lower().replace(".", " ").split()
            ][:CONTEXT]
            out[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        return out


class TinyVisual(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(3 * 4 * 4, width)
        self.ln = nn.LayerNorm(width)
        self.proj = nn.Linear(width, EMBED_DIM)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        pooled = F.adaptive_avg_pool2d(images, 4).flatten(1)
        return self.proj(torch.tanh(self.ln(self.fc(pooled))))


class TinyClip(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.visual = TinyVisual(width)
        self.token_embedding = nn.Embedding(VOCAB, width)
        self.ln_final = nn.LayerNorm(width)
        self.text_projection = nn.Linear(width, EMBED_DIM)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(10.0)))

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        return self.visual(images)

    def encode_text(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = (tokens != 0).unsqueeze(-1).float()
        emb = (self.token_embedding(tokens) * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        return self.text_projection(self.ln_final(emb))


def check_args(*, seed: int = 0, width: int = 16) -> None:
    """Cheap validation of the factory's arguments (the CLI calls it before any setup)."""
    if int(width) < 1:
        raise ValueError(f"width must be >= 1, got {width}")


def tiny_clip(*, seed: int = 0, width: int = 16) -> ModelBundle:
    """The tiny CLIP with weights drawn from ``seed`` (global RNG state untouched)."""
    global builds
    check_args(seed=seed, width=width)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        clip = TinyClip(width)
    builds += 1
    return ModelBundle(
        clip=clip,
        tokenizer=TinyTokenizer(),
        preprocess=Preprocess(IMAGE_SIZE, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)),
        name="tiny-clip",
        weights=f"random-seed{seed}-width{width}",
    )


tiny_clip.check_args = check_args  # type: ignore[attr-defined]
