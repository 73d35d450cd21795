"""TPT: test-time prompt tuning of CLIP's text context.

Paper: Shu et al., "Test-Time Prompt Tuning for Zero-Shot Generalization in Vision-Language
Models", NeurIPS 2022. Official code: https://github.com/azshue/TPT
Setting (defaults): 4 learnable context token embeddings shared by all classes, initialised
from the token embeddings of "a photo of a" (prompt "<ctx> {class}."), 64 views (original +
63 random resized crops with flip), keep the 10% lowest-entropy views, loss = entropy of
their mean prediction (``marginal_entropy``), AdamW 5e-3 (torch's default weight decay
0.01), 1 step, context and optimiser reset after every sample; the prediction is made on
the original image with the updated prompt.
What differs and why:
* The image tower is frozen and the prompt only changes the text side, so the image
  features of all views of the whole batch are computed once, batched, without gradients
  (the official code re-runs the image encoder per step); the result is the same.
* The text transformer is causal, so features at the end-of-text token do not depend on
  later (padding) positions: sequences are cut after the longest prompt's end token. Exact,
  and several times cheaper with 77-token contexts.
* Views are drawn by one batched ``grid_sample`` instead of PIL transforms; no AugMix.
* The per-sample episodes of a batch run in parallel (``episode_batching``, see _views.py):
  each sample gets its own context copy and all B x C prompts go through one text forward;
  exactly the per-sample loop, since the context is the only adapted parameter.
* TPT's head is its single learned prompt, not the zero-shot prompt ensemble, so its
  starting point differs from ``zeroshot`` (as in the paper).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mura_plugin.methods._views import MultiViewConfig, MultiViewMethod
from tta_bench.model import ZeroShotClassifier

__all__ = ["TPT", "TPTConfig", "PromptTextEncoder"]


@dataclass
class TPTConfig(MultiViewConfig):
    ctx_init: str = "a photo of a"
    selection: float = 0.1  # fraction of lowest-entropy views kept by the loss
    loss: str = "marginal_entropy"
    optimizer: str = "adamw"
    lr: float = 5e-3
    weight_decay: float = 0.01
    steps: int = 1


class PromptTextEncoder(nn.Module):
    """Class text features from learnable context embeddings, through open_clip's text
    transformer exactly as ``CLIP.encode_text`` does (token + positional embedding,
    causal transformer, final LayerNorm, end-token pooling, projection).

    Prompts are ``"{ctx_init} {classname}."``; positions ``1 .. n_ctx`` (after the start
    token) hold ``ctx [n_ctx, width]``, initialised from ``ctx_init``'s token embeddings.
    """

    def __init__(self, model: ZeroShotClassifier, ctx_init: str):
        super().__init__()
        clip = model.clip
        needed = ("token_embedding", "positional_embedding", "transformer", "ln_final")
        if not all(hasattr(clip, a) for a in needed):
            raise ValueError(
                f"tpt needs an open_clip CLIP with a built-in text transformer ({needed}); "
                f"{type(clip).__name__} does not have one"
            )
        if getattr(clip, "text_pool_type", "argmax") not in ("argmax", "eos"):
            raise ValueError(f"tpt needs end-token pooling, got {clip.text_pool_type!r}")
        # a reference, not a submodule: the encoder owns only its context parameter
        object.__setattr__(self, "clip", clip)
        words = ctx_init.strip()
        if not words:
            raise ValueError("ctx_init must be a non-empty phrase, e.g. 'a photo of a'")
        device = clip.token_embedding.weight.device
        ctx_tokens = model.tokenizer([words])[0]
        self.n_ctx = int((ctx_tokens != 0).sum()) - 2  # minus start and end tokens
        tokens = model.tokenizer([f"{words} {c}." for c in model.classnames]).to(device)
        self.end = self._end_positions(tokens)
        length = int(self.end.max()) + 1  # causal: later positions never reach the end token
        self.register_buffer("tokens", tokens[:, :length], persistent=False)
        with torch.no_grad():
            embedded = clip.token_embedding(self.tokens)
        self.register_buffer("prefix", embedded[:, :1].clone(), persistent=False)
        self.register_buffer("suffix", embedded[:, 1 + self.n_ctx :].clone(), persistent=False)
        self.ctx = nn.Parameter(embedded[0, 1 : 1 + self.n_ctx].clone())

    def _end_positions(self, tokens: torch.Tensor) -> torch.Tensor:
        if getattr(self.clip, "text_pool_type", "argmax") == "eos":
            return (tokens == self.clip.text_eos_id).int().argmax(dim=-1)
        return tokens.argmax(dim=-1)

    def forward(self, ctx: torch.Tensor | None = None) -> torch.Tensor:
        """L2-normalised class text features: ``[C, D]`` from ``ctx [n_ctx, width]`` (default:
        the parameter), or ``[S, C, D]`` from per-sample contexts ``ctx [S, n_ctx, width]``
        (all S x C prompts in one text forward)."""
        ctx = self.ctx if ctx is None else ctx
        c = self.prefix.shape[0]
        if ctx.dim() == 3:
            s = ctx.shape[0]
            x = torch.cat(
                [
                    self.prefix.expand(s, -1, -1, -1),
                    ctx.unsqueeze(1).expand(-1, c, -1, -1),
                    self.suffix.expand(s, -1, -1, -1),
                ],
                dim=2,
            ).flatten(0, 1)
            return self._encode(x, s * c).view(s, c, -1)
        x = torch.cat([self.prefix, ctx.unsqueeze(0).expand(c, -1, -1), self.suffix], 1)
        return self._encode(x, c)

    def _encode(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """Text transformer on embedded prompts ``x [rows, L, width]`` (class-major within
        each group of C): normalised features at the end tokens ``[rows, D]``."""
        clip = self.clip
        c = self.prefix.shape[0]
        cast = clip.transformer.get_cast_dtype()
        n = x.shape[1]
        x = x.to(cast) + clip.positional_embedding[:n].to(cast)
        mask = clip.attn_mask[:n, :n] if clip.attn_mask is not None else None
        x = clip.transformer(x, attn_mask=mask)
        x = clip.ln_final(x)
        end = self.end.repeat(rows // c)
        x = x[torch.arange(rows, device=x.device), end]
        proj = clip.text_projection
        if proj is not None:
            x = proj(x) if isinstance(proj, nn.Linear) else x @ proj
        return F.normalize(x, dim=-1)


class TPT(MultiViewMethod):
    Config = TPTConfig

    def configure(self, model: ZeroShotClassifier) -> None:
        if not 0.0 < self.config.selection <= 1.0:
            raise ValueError(f"selection must be in (0, 1], got {self.config.selection}")
        self.prompt = PromptTextEncoder(model, self.config.ctx_init)
        self._episode_ctx: torch.Tensor | None = None  # copies in use ([n, n_ctx, width])
        self._episode_ctx_all: torch.Tensor | None = None

    def collect_params(self, model: ZeroShotClassifier) -> list[nn.Parameter]:
        return [self.prompt.ctx]

    def supports_episode_batching(self) -> bool:
        return True

    def begin_episodes(self, n: int) -> list[torch.Tensor]:
        ctx = self.prompt.ctx.detach().unsqueeze(0).repeat(n, 1, 1)
        self._episode_ctx = self._episode_ctx_all = ctx.requires_grad_(True)
        return [ctx]

    def select_episodes(self, rows: slice) -> None:
        self._episode_ctx = self._episode_ctx_all[rows]

    def end_episodes(self) -> None:
        self._episode_ctx = self._episode_ctx_all = None

    @torch.no_grad()
    def encode_views(self, views: torch.Tensor) -> torch.Tensor:
        """Image features ``[V, B, D]`` of all views (frozen tower, chunked)."""
        v, b = views.shape[:2]
        flat = views.flatten(0, 1)
        chunk = self.config.chunk_views
        with self.autocast():
            feats = torch.cat(
                [self.model.encode_image(flat[i : i + chunk]) for i in range(0, len(flat), chunk)]
            )
        return feats.float().view(v, b, -1)

    def _logits(self, feats: torch.Tensor) -> torch.Tensor:
        """Logits ``[..., B, C]`` of image features ``[..., B, D]`` under the prompt (or, in
        batched episodes, sample b's features under sample b's prompt)."""
        if self._episode_ctx is None:
            return self.model.logits_from_features(feats, self.prompt().to(feats.dtype))
        text = self.prompt(self._episode_ctx).to(feats.dtype)  # [B, C, D]
        return self.model.logit_scale * torch.einsum("...bd,bcd->...bc", feats, text)

    def view_loss(self, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self._logits(feats)
        return self.loss_fn(logits, top=self.config.selection, features=feats), logits

    @torch.no_grad()
    def predict_episode(self, images: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        if not self.config.include_original:
            return self.predict(images)
        with self.autocast():
            return self._logits(feats[0]).float()

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            return self._logits(self.model.encode_image(images)).float()
