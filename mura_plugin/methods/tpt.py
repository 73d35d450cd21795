"""TPT: test-time prompt tuning of CLIP's text context.

Paper: Shu et al., "Test-Time Prompt Tuning for Zero-Shot Generalization in Vision-Language
Models", NeurIPS 2022. Official code: https://github.com/azshue/TPT, read at commit
63ecbace79694205d7884e63fdc3137a200f0b0e (tpt_classification.py, clip/custom_clip.py,
data/datautils.py, data/augmix_ops.py, scripts/test_tpt.sh).

Setting (defaults = the official script, ``--tpt --ctx_init a_photo_of_a``): learnable
context token embeddings initialised from the template text; 64 views (original + 63
RandomResizedCrop + horizontal flip; AugMix only on its fine-grained sets); the
``int(64 * 0.1) = 6`` lowest-entropy views are selected at the first step, on the initial
prompt, and kept for later steps (``selected_idx``); loss = entropy of their mean
prediction (``marginal_entropy``); AdamW lr 5e-3 (torch's default weight decay 0.01), 1
step; context and optimiser state reset before every sample; the prediction is made on the
original image with the updated prompt; on CUDA fp16 autocast over fp32 weights (its
``clip.load`` keeps fp32: ``convert_weights`` is commented out) with
``GradScaler(init_scale=1000)``.

Text head (``text_head``):
* ``protocol`` (default): one learnable context per protocol template, initialised from the
  token embeddings of the template's text before the class name (its class name and
  suffix stay fixed); the class embedding is the normalised mean over templates of the
  normalised features, as ``ZeroShotClassifier`` builds it, so before any step TPT is
  exactly the zero-shot classifier (tests/test_method_text_heads.py).
* ``official``: the official prompt learner, 4 context tokens "a photo of a" (``ctx_init``)
  before "{class}." (one template).

What differs and why:
* Views: torchvision's RandomResizedCrop boxes drawn on the image at the model's size and
  resized by one batched bilinear ``grid_sample`` (augment.py); the official crops the raw
  image (before Resize + CenterCrop) with PIL. AugMix (the official, augment.py) on the
  fine-grained sets only, as the official ``augmix=len(set_id) > 1``: the harness applies
  the rule per dataset (``augmix`` left at its default is on for a dataset the catalogue
  marks ``fine_grained``: the ten cross-domain sets; its catalogue entry's ``dataset_flags``).
* The image tower is frozen and the prompt only changes the text side, so the image
  features of all views of the whole batch are computed once, batched, without gradients
  (the official code re-runs the image encoder per step); the result is the same.
* The text transformer is causal, so features at the end-of-text token do not depend on
  later (padding) positions: sequences are cut after the longest prompt's end token. Exact,
  and several times cheaper with 77-token contexts.
* The per-sample episodes of a batch run in parallel (``episode_batching``, see _episodes.py):
  each sample gets its own context copy and all B x T x C prompts go through one text
  forward; exactly the per-sample loop, since the context is the only adapted parameter.
* Loss scaling per episode (``_loss_scaler.LossScaler``) instead of one GradScaler over the
  sample stream: the same unless an fp16 step overflows.
* The official ``avg_entropy`` clamps the log of the mean probability at the dtype's
  minimum; here it is computed in float32 log space (no clamp is reached).

Measured effect (the crop boxes, the official head): docs/methods.md#tpt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mura_plugin.losses import view_entropy
from mura_plugin.methods._clip_text import end_positions
from mura_plugin.methods._episodes import MultiViewConfig, MultiViewMethod
from tta_bench.bounds import bounded
from tta_bench.model import ZeroShotClassifier

__all__ = ["TPT", "TPTConfig", "PromptTextEncoder"]


@dataclass
class TPTConfig(MultiViewConfig):
    ctx_init: str = "a photo of a"  # the official head's context (text_head=official)
    selection: float = bounded(0.1, gt=0, le=1)  # fraction of lowest-entropy views kept by the loss
    loss: str = "marginal_entropy"
    optimizer: str = "adamw"
    lr: float = 5e-3
    weight_decay: float = 0.01
    steps: int = 1


class PromptTextEncoder(nn.Module):
    """Class text features from learnable context embeddings, through open_clip's text
    transformer exactly as ``CLIP.encode_text`` does (token + positional embedding, causal
    transformer, final LayerNorm, end-token pooling, projection), averaged over templates as
    ``ZeroShotClassifier`` builds its head (normalised mean of normalised features).

    Template t (one ``{}`` for the class name) is split at the ``{}``: the tokens of its text
    before the class name are its context, ``ctx_t [n_t, width]`` at positions ``1 .. n_t``
    (after the start token), learnable and initialised from their token embeddings; the
    class name and the rest of the template are fixed. All contexts are rows of one
    parameter ``ctx [sum_t n_t, width]`` (template order). With the template
    ``"a photo of a {}."`` this is TPT's prompt learner with ``ctx_init = "a photo of a"``.
    """

    def __init__(self, model: ZeroShotClassifier, templates: Sequence[str]):
        super().__init__()
        clip = model.clip
        needed = ("token_embedding", "positional_embedding", "transformer", "ln_final")
        if not all(hasattr(clip, a) for a in needed):
            raise ValueError(
                f"prompt tuning (tpt and the methods on its prompt learner) supports open_clip's "
                f"CLIP class, whose text transformer is built in (architectures without "
                f"custom_text: ViT-B-16, RN50, convnext_base, ...); {model.model_name} is a "
                f"{type(clip).__name__} with a separate text tower (custom_text: EVA02, SigLIP, "
                f"CoCa, Hugging Face text towers), which it does not support"
            )
        if getattr(clip, "text_pool_type", "argmax") not in ("argmax", "eos"):
            raise ValueError(f"tpt needs end-token pooling, got {clip.text_pool_type!r}")
        # a reference, not a submodule: the encoder owns only its context parameter
        object.__setattr__(self, "clip", clip)
        templates = list(templates)
        if not templates:
            raise ValueError("tpt needs at least one prompt template")
        device = clip.token_embedding.weight.device
        self.n_templates, self.n_classes = len(templates), len(model.classnames)
        rows, sizes = [], []
        for template in templates:
            if template.count("{}") != 1:
                raise ValueError(f"a template needs exactly one '{{}}', got {template!r}")
            words = template.split("{}")[0].strip()
            context = model.tokenizer([words])[0] if words else None
            n = int((context != 0).sum()) - 2 if words else 0  # minus start and end tokens
            tokens = model.tokenizer([template.format(c) for c in model.classnames])
            if n and not bool((tokens[:, 1 : 1 + n] == context[1 : 1 + n]).all()):
                raise ValueError(
                    f"template {template!r}: the tokens of {words!r} are not a prefix of its "
                    "prompts (the class name must follow a space)"
                )
            rows.append(tokens)
            sizes.append(n)
        if sum(sizes) == 0:
            raise ValueError(f"no template has text before the class name: {templates}")
        tokens = torch.cat(rows).to(device)  # [T * C, L], template-major
        self.end = end_positions(self.clip, tokens)
        length = int(self.end.max()) + 1  # causal: later positions never reach the end token
        tokens = tokens[:, :length]
        # per row: which positions hold context, and which row of ``ctx`` each one reads
        c = self.n_classes
        positions = torch.arange(length, device=device)
        size = torch.tensor(sizes, device=device).repeat_interleave(c)[:, None]
        offset = (torch.tensor([0, *sizes[:-1]], device=device).cumsum(0)).repeat_interleave(c)
        self.register_buffer("is_ctx", (positions >= 1) & (positions <= size), persistent=False)
        index = (offset[:, None] + positions - 1).clamp_min(0) * self.is_ctx
        self.register_buffer("ctx_index", index, persistent=False)
        with torch.no_grad():
            embedded = clip.token_embedding(tokens)
        self.register_buffer("embedded", embedded, persistent=False)
        first = [t * c for t in range(len(templates))]  # one row of each template
        ctx = torch.cat([embedded[r, 1 : 1 + n] for r, n in zip(first, sizes)])
        self.ctx = nn.Parameter(ctx.clone())
        self.n_ctx = sizes

    def forward(self, ctx: torch.Tensor | None = None) -> torch.Tensor:
        """L2-normalised class embeddings: ``[C, D]`` from ``ctx [N, width]`` (default: the
        parameter), or ``[S, C, D]`` from per-sample contexts ``ctx [S, N, width]`` (all
        S x T x C prompts in one text forward)."""
        ctx = self.ctx if ctx is None else ctx
        x = torch.where(self.is_ctx[..., None], ctx[..., self.ctx_index, :], self.embedded)
        lead = x.shape[:-3]  # () or (S,)
        feats = self._encode(x.reshape(-1, *x.shape[-2:]))  # [S * T * C, D]
        feats = feats.view(*lead, self.n_templates, self.n_classes, -1).mean(dim=-3)
        return F.normalize(feats, dim=-1)

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        """Text transformer on embedded prompts ``x [rows, L, width]`` (groups of the T x C
        prompts): normalised features at the end tokens ``[rows, D]``."""
        clip = self.clip
        cast = clip.transformer.get_cast_dtype()
        rows, n = x.shape[:2]
        x = x.to(cast) + clip.positional_embedding[:n].to(cast)
        mask = clip.attn_mask[:n, :n] if clip.attn_mask is not None else None
        x = clip.transformer(x, attn_mask=mask)
        x = clip.ln_final(x)
        end = self.end.repeat(rows // len(self.end))
        x = x[torch.arange(rows, device=x.device), end]
        proj = clip.text_projection
        if proj is not None:
            x = proj(x) if isinstance(proj, nn.Linear) else x @ proj
        return F.normalize(x, dim=-1)


class TPT(MultiViewMethod):
    #: Encodes its prompts from the protocol's templates (``model.templates``): the
    #: per-class sentence modes of ``protocol.text_head`` are refused before a run.
    text_heads = ("templates",)

    predict_reads_original = True  # predict_episode reads view 0 only
    Config = TPTConfig
    stream_kind = "episodic"  # the prompt and optimiser reset before every sample

    def configure(self, model: ZeroShotClassifier) -> None:
        cfg = self.config
        if cfg.text_head == "protocol":
            templates = model.templates
        else:
            words = cfg.ctx_init.strip()
            if not words:
                raise ValueError("ctx_init must be a non-empty phrase, e.g. 'a photo of a'")
            templates = [f"{words} {{}}."]  # TPT: prompt_prefix + " " + classname + "."
        self.prompt = PromptTextEncoder(model, templates)
        self._episode_ctx: torch.Tensor | None = None  # copies in use ([n, N, width])
        self._episode_ctx_all: torch.Tensor | None = None
        #: The confident views of the running episode(s), ``[k, B]`` per chunk of samples,
        #: chosen at the first step (on the initial prompt) and kept for the later ones.
        self.selected_views: dict[int | None, torch.Tensor] = {}

    def collect_params(self, model: ZeroShotClassifier) -> list[nn.Parameter]:
        return [self.prompt.ctx]

    @torch.no_grad()
    def class_embeddings(self) -> torch.Tensor:
        """The text head this method classifies with before adapting ``[C, D]``."""
        return self.prompt()

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
        """The loss on the confident views: the ``int(V * selection)`` (at least one)
        lowest-entropy views, chosen at the episode's first step and kept for later steps,
        as the official ``test_time_tuning`` does (``selected_idx``)."""
        logits = self._logits(feats)  # [V, B, C]
        key = self.loss_rows  # the chunk of samples (None: all, or one episode)
        if self.step_index == 0 or key not in self.selected_views:
            k = max(1, int(logits.shape[0] * self.config.selection))
            self.selected_views[key] = view_entropy(logits.detach()).argsort(dim=0)[:k]
        chosen = self.selected_views[key]  # [k, B]
        kept = logits.gather(0, chosen[..., None].expand(-1, -1, logits.shape[-1]))
        kept_feats = feats.gather(0, chosen[..., None].expand(-1, -1, feats.shape[-1]))
        return self.loss_fn(kept, top=1.0, features=kept_feats), logits

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
