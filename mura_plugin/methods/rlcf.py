"""RLCF: test-time prompt tuning with a CLIP reward (REINFORCE with a teacher CLIPScore).

Paper: Zhao et al., "Test-Time Adaptation with CLIP Reward for Zero-Shot Generalization in
Vision-Language Models", ICLR 2024, https://openreview.net/forum?id=kIP0duasBb. Official code:
https://github.com/mzhaoshuai/RLCF, read at commit 0996a5d5bdeea9108c36bd0c5a71bba652945cd4
(TPT/tpt_cls_rl.py, TPT/clip_reward.py, TPT/params.py, TPT/scripts/rlcf-prompt.sh,
TPT/scripts/rlcf-prompt-fine.sh, TPT/data/datautils.py, TPT/clip/custom_clip.py,
TPT/clip/clip.py). TTA-VLM's implementation read too: https://github.com/TomSheng21/tta-vlm
at commit bcc735fe49cbd2ab5b683781c41c66e1d3f78589 (instance_method/rlcf.py,
instance_tta.py).

Implemented variant: the prompt-tuning classification one (``tpt_cls_rl.py``, TPT-style
context tuning). The repository's other classification variant, tuning the image encoder
(``tune_cls_rl.py``, ``rlcf-tune.sh``), and its retrieval / captioning variants are not
implemented.

Per test image (an episode; the context and the optimiser are reset before each image):
64 views (the original + 63 RandomResizedCrop + flip views, TPT's ``AugMixAugmenter``);
the student (CLIP with learnable context) scores them and keeps the ``int(64 * 0.1) = 6``
lowest-entropy views, chosen at the first step and kept for later steps
(``selected_idx``); the teacher encodes those views once. Each step: for each kept view
the student's top-``K`` classes (``torch.topk``: deterministic, not sampled) are its
"actions"; the reward of (view, class) is the teacher's CLIPScore
``max(2.5 * cos(teacher image feature, teacher class text feature), 0)``; the baseline is
the mean reward over the K classes of the same view (``reward_process=1``,
``process_batch=0``), no division by the standard deviation (``reward_amplify=0``); the
loss is ``mean over views and classes of (reward - baseline) * CE(student logits, class)``,
the REINFORCE gradient of the expected reward under the student's softmax. The prediction
is the student's on the original image after the last step.

Setting (defaults = the official scripts: ``rlcf-prompt.sh`` on the ImageNet sets,
``rlcf-prompt-fine.sh`` on the fine-grained ones): ViT-B/16 student with
``--ctx_init a_photo_of_a`` (4 context tokens before "{class}."); ``sample_k`` 3;
CLIPScore weight 2.5 (``CLIPRewards`` default); AdamW lr 7e-3, weight decay 5e-4, 3 steps
(``tta_steps``) on the ImageNet sets and 5 on the fine-grained ones (the fine-grained
script's ``case 01``: ``tta_steps=5``, lr 7e-3 again), applied per dataset:
``steps_fine_grained`` (5) where the dataset's catalogue entry says ``fine_grained: true``,
``steps`` (3) elsewhere, so 3 on every shipped suite (``steps_fine_grained=null``: ``steps``
everywhere; ``resolved_settings`` records the steps used); 64 views (``batch_size``),
selection 0.1; views without AugMix on its ImageNet sets and with it on its fine-grained
ones (applied per dataset as for tpt.py); fp16 autocast over fp32 weights
(``convert_weights`` is commented out in its ``clip.py``) with
``GradScaler(init_scale=1000)``; the reward model (teacher) is ViT-L/14
(``reward_arch``), its class text features are those of the student's initial hard
prompts (``tokenized_prompts``: "a photo of a {class}."), its image features those of the
kept views (bicubic-resized when its input size differs). ``min_entropy_reg`` (off in
every script), ``confidence_gap``, ``multiple_reward_models``, ``momentum_update`` are
experimental options of its code that no script turns on: not implemented.

Teacher (``teacher``): a registered model name (``tta-bench ls models``), built in
``setup`` with ``registry("models").get(teacher)(**teacher_args)`` and moved to the
student's device; its zero-shot head uses the same class names and the same templates as
the student's head (``text_head``: the protocol's templates, or "{ctx_init} {class}."
under ``official``). Nothing is downloaded: a teacher whose weights are not on the machine
fails to build. ``resolved_settings`` records the teacher's model name, weights tag and
weights SHA-256 in the results. None (default): the student's own frozen CLIP (its image
features of the kept views and its hard-prompt head).

TTA-VLM (``tta_vlm``): its reward model is ``CLIPRewards(arch=args.arch)``, the student's
own architecture (``teacher=None`` here), and it runs 3 steps on every set
(``args.tta_steps = 3`` in instance_method/rlcf.py: ``steps_fine_grained=None``); every other
value equals the official ImageNet script (sample_k 3, lr 7e-3, weight decay 5e-4,
selection 0.1, 64 views, AugMix on the fine-grained sets as in the official code, no CoOp
initialisation).

What differs and why:
* The teacher defaults to the student's own model, not the official larger CLIP
  (ViT-L/14 for a ViT-B/16 student): nothing is downloaded and a benchmark has one model;
  set ``teacher`` (and ``teacher_args``) to a registered larger model for the official
  setting. Same as TTA-VLM's choice. Not measured.
* The official scripts initialise the context from CoOp weights trained 16-shot on
  ImageNet (``--load coop_16shots_nctx4...``); here it starts from the template's token
  embeddings ("a photo of a", or the protocol's templates under the default head), as
  TTA-VLM's commands do (no ``--load``): no CoOp weights exist for the benchmark's
  models. Not measured.
* Text head: ``protocol`` (default) tunes one context per protocol template (see tpt.py)
  and gives the teacher the protocol's templates; ``official`` is the official prompt
  learner and teacher prompt. Not measured for RLCF.
* Views, batched per-sample episodes, per-episode loss scaling, frozen-tower image
  features computed once per batch, causal text cut: as in tpt.py (same effects, exact
  except the views' crop implementation).
* The teacher's class head is computed once in float32 (``ZeroShotClassifier``, cached);
  the official computes it under fp16 autocast. On the CPU everything is float32.
* The teacher encodes the kept views once per episode (its official
  ``set_image_features`` does the same, at the first step).
* Steps per dataset: the official scripts choose them by the script a set is run with;
  here by the catalogue's ``fine_grained`` flag (the ten sets of ``rlcf-prompt-fine.sh``).
  A run that sets ``steps`` itself sets it on the non-fine-grained sets only; on the
  fine-grained ones ``steps_fine_grained`` decides (set it too, or null).

Measured effect: docs/methods.md#rlcf.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch
import torch.nn.functional as F

from mura_plugin.losses import view_entropy
from mura_plugin.methods._aux_model import aux_classifier
from mura_plugin.methods._text_heads import class_head
from mura_plugin.methods.tpt import TPT, TPTConfig
from tta_bench.bounds import bounded
from tta_bench.catalog import fine_grained
from tta_bench.model import ZeroShotClassifier

__all__ = ["RLCF", "RLCFConfig", "clip_reward", "rlcf_loss"]


@dataclass
class RLCFConfig(TPTConfig):
    loss: Optional[str] = None  # the objective is fixed: the policy-gradient loss below
    lr: float = 7e-3
    weight_decay: float = 5e-4
    steps: int = 3  # rlcf-prompt.sh (the ImageNet sets)
    #: steps on the catalogue's fine-grained sets (rlcf-prompt-fine.sh: 5); None: steps
    steps_fine_grained: Optional[int] = bounded(5, ge=0)
    sample_k: int = bounded(3, ge=1)  # top-K classes of the student per kept view
    clipscore_weight: float = bounded(2.5, gt=0)  # CLIPScore = max(w * cos, 0)
    reward_baseline: bool = True  # reward_process: subtract the mean reward
    reward_std: bool = False  # reward_amplify: also divide by the std (+1e-5)
    baseline_over_views: bool = False  # process_batch: mean over all views x K, not per view
    #: A registered model name (None: the student's own model); see the module docstring.
    teacher: Optional[str] = None
    #: Keyword arguments of the teacher's model factory (e.g. openclip's arch/pretrained).
    teacher_args: dict[str, Any] = field(default_factory=dict)

    #: added after results were recorded: at its default only fine-grained sets change
    hash_omit_at_default = (*TPTConfig.hash_omit_at_default, "steps_fine_grained")


def clip_reward(
    teacher_sims: torch.Tensor,
    index: torch.Tensor,
    clipscore_weight: float = 2.5,
    baseline: bool = True,
    std: bool = False,
    over_views: bool = False,
) -> torch.Tensor:
    """Rewards ``[B, n, K]`` of the classes ``index [B, n, K]`` chosen for the n views of
    each of B episodes, from the teacher's cosine similarities ``teacher_sims [B, n, C]``:
    CLIPScore ``max(w * cos, 0)``, minus its mean over the K classes of the view (or over
    all n x K of the episode with ``over_views``) when ``baseline``, divided by the
    (unbiased) standard deviation + 1e-5 when ``std``. As the official
    ``rewards_post_process``, nothing is subtracted from a group of one."""
    score = (clipscore_weight * teacher_sims.float().gather(-1, index)).clamp_min(0.0)
    if not baseline:
        return score
    group = score.flatten(1) if over_views else score
    if group.shape[-1] > 1:
        centred = group - group.mean(dim=-1, keepdim=True)
        if std:
            centred = centred / (group.std(dim=-1, keepdim=True) + 1e-5)
        group = centred
    return group.reshape(score.shape)


def rlcf_loss(
    logits: torch.Tensor,
    teacher_sims: torch.Tensor,
    sample_k: int,
    clipscore_weight: float = 2.5,
    baseline: bool = True,
    std: bool = False,
    over_views: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The policy-gradient loss per episode ``[B]`` from the student's logits
    ``[B, n, C]`` of its n kept views and the teacher's similarities ``[B, n, C]``: the
    student's top-``sample_k`` classes per view, their rewards (``clip_reward``, no
    gradient) and ``mean over n x K of reward * cross_entropy(logits, class)``. Returns
    ``(loss [B], rewards [B, n, K], index [B, n, K])``."""
    index = logits.detach().topk(sample_k, dim=-1).indices
    with torch.no_grad():
        rewards = clip_reward(
            teacher_sims, index, clipscore_weight, baseline=baseline, std=std, over_views=over_views
        )
    ce = -logits.float().log_softmax(dim=-1).gather(-1, index)
    return (rewards * ce).flatten(1).mean(dim=1), rewards, index


class RLCF(TPT):
    Config = RLCFConfig
    stream_kind: ClassVar[str] = "episodic"

    # -- setup ---------------------------------------------------------------------------
    def configure(self, model: ZeroShotClassifier) -> None:
        super().configure(model)
        cfg = self.config
        self.steps = cfg.steps
        if cfg.steps_fine_grained is not None and fine_grained(model.dataset):
            self.steps = cfg.steps_fine_grained
        if self.steps != cfg.steps:  # the episode loop reads config.steps
            self.config = cfg = dataclasses.replace(cfg, steps=self.steps)
        if cfg.sample_k > model.num_classes:
            raise ValueError(
                f"sample_k={cfg.sample_k} exceeds the number of classes ({model.num_classes})"
            )
        if cfg.text_head == "protocol":
            templates = list(model.templates)
        else:
            templates = [f"{cfg.ctx_init.strip()} {{}}."]  # the official tokenized_prompts
        if cfg.teacher is None:
            self.teacher: ZeroShotClassifier | None = None
            self.teacher_text = class_head(model, cfg.text_head, templates).float()
            self._teacher_info = {
                "teacher": None,
                "teacher_model": model.model_name,
                "teacher_weights": model.weights,
                "teacher_weights_sha256": None,  # the student's: recorded with the model
            }
        else:
            self.teacher, bundle = aux_classifier(
                model, cfg.teacher, cfg.teacher_args, templates, self.device
            )
            self.teacher_text = self.teacher.class_embeddings.detach().float()
            self._teacher_info = {
                "teacher": cfg.teacher,
                "teacher_model": bundle.name,
                "teacher_weights": bundle.weights,
                "teacher_weights_sha256": bundle.weights_sha256,
            }
        #: Per chunk of episodes: the teacher's similarities of the kept views ``[k, B, C]``.
        self.teacher_sims: dict[int | None, torch.Tensor] = {}
        #: The rewards of the last step ``[B, k, K]`` (detached), for inspection.
        self.last_rewards: torch.Tensor | None = None

    def resolved_settings(self) -> dict[str, Any]:
        return {"steps": self.steps, **self._teacher_info}

    def batched_episodes(self) -> bool:
        # the loss of sample i depends on sample i's views only: batched episodes are exact
        cfg = self.config
        return cfg.episodic == "sample" and cfg.episode_batching

    # -- views ---------------------------------------------------------------------------
    @torch.no_grad()
    def encode_views(self, views: torch.Tensor) -> dict[str, torch.Tensor]:
        """The student's image features ``[V, B, D]`` and, for a separate teacher, the views
        themselves (the teacher encodes the kept ones)."""
        out = {"feats": super().encode_views(views)}
        if self.teacher is not None:
            out["views"] = views
        return out

    @torch.no_grad()
    def teacher_features(self, inputs: dict[str, torch.Tensor], chosen: torch.Tensor):
        """The teacher's L2-normalised image features ``[k, B, D]`` of the views ``chosen
        [k, B]``."""
        if self.teacher is None:  # the student's frozen tower: its features are at hand
            feats = inputs["feats"]
            return feats.gather(0, chosen[..., None].expand(-1, -1, feats.shape[-1])).float()
        views = inputs["views"]
        b = views.shape[1]
        kept = views[chosen, torch.arange(b, device=chosen.device)[None, :]]  # [k, B, 3, H, W]
        flat = kept.flatten(0, 1)
        size = self.teacher.preprocess.image_size
        if flat.shape[-1] != size or flat.shape[-2] != size:
            # as the official reward model: bicubic, align_corners=True (it resizes the
            # normalised images; the per-channel affine normalisation commutes with it)
            flat = F.interpolate(flat, size=size, mode="bicubic", align_corners=True)
        chunk = self.config.chunk_views
        with self.autocast():
            feats = torch.cat(
                [self.teacher.encode_image(flat[i : i + chunk]) for i in range(0, len(flat), chunk)]
            )
        return F.normalize(feats.float(), dim=-1).view(*chosen.shape, -1)

    # -- loss ----------------------------------------------------------------------------
    def view_loss(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy-gradient loss per sample on its confident views: the
        ``int(V * selection)`` (at least one) lowest-entropy views, chosen at the episode's
        first step with the teacher's similarities of them, both kept for later steps."""
        cfg = self.config
        feats = inputs["feats"]
        logits = self._logits(feats)  # [V, B, C]
        key = self.loss_rows  # the chunk of samples (None: all, or one episode)
        if self.step_index == 0 or key not in self.selected_views:
            k = max(1, int(logits.shape[0] * cfg.selection))
            chosen = view_entropy(logits.detach()).argsort(dim=0)[:k]
            self.selected_views[key] = chosen
            teacher = self.teacher_features(inputs, chosen)  # [k, B, D]
            self.teacher_sims[key] = teacher @ self.teacher_text.t()
        chosen = self.selected_views[key]
        kept = logits.gather(0, chosen[..., None].expand(-1, -1, logits.shape[-1]))
        loss, rewards, _ = rlcf_loss(
            kept.transpose(0, 1),
            self.teacher_sims[key].transpose(0, 1),
            cfg.sample_k,
            cfg.clipscore_weight,
            baseline=cfg.reward_baseline,
            std=cfg.reward_std,
            over_views=cfg.baseline_over_views,
        )
        self.last_rewards = rewards
        return loss, logits

    @torch.no_grad()
    def predict_episode(self, images: torch.Tensor, inputs: dict[str, torch.Tensor]):
        return super().predict_episode(images, inputs["feats"])
