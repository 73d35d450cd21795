"""Open-set evaluation: a declared out-of-distribution (OOD) dataset mixed into the stream,
and the detection metrics computed on the cell's logits (docs/benchmarks.md#open-set-evaluation).

A protocol's ``ood`` (``Protocol.ood``, from the suite's ``ood:`` or the run's
``protocol.ood_dataset=`` / ``ood_ratio=`` / ``ood_seed=`` / ``ood_score=`` /
``ood_dataset_args=``) names a registered dataset whose images join every test split:

* ``ratio`` is the OOD share of the mixed split: ``n_ood = round(ratio / (1 - ratio) * n_id)``
  OOD images, a fixed subset drawn with ``seed`` (the same images in every domain and run
  seed); too few OOD images is a ``ValueError`` naming both counts, unless ``repeat``
  (``protocol.ood_repeat=true``, ZS-NTTA's rule: the whole set repeated, then a drawn
  rest; ``ood_rows``);
* the mixed split is the in-distribution rows followed by the chosen OOD rows; the stream
  shuffles it per run seed as it shuffles every split, and a synthetic shift corrupts the
  OOD images as it corrupts the others (they come from the same shifted world);
* an OOD set sharing a class name with the in-distribution set is refused, naming the
  classes (``check_disjoint``; names compared ignoring case, ``_``, ``-``);
* an OOD row's label is ``OOD_LABEL`` (-1): labels never reach the method, and the runner
  scores the closed-set metrics (accuracy, NLL, ECE) on the in-distribution rows only;
* the open-set metrics (``OPEN_SET_METRICS``) take the whole cell: the in-distribution rows
  are the positives, and the OOD score (``SCORES``, higher = more in-distribution) is the
  maximum softmax probability (``msp``, default) or the negative energy
  ``logsumexp(logits)`` (``energy``; Liu et al. 2020, temperature 1).

The protocol id hashes the whole ``ood`` entry (dataset, arguments, ratio, seed, score), and
the id's readable part carries ``-ood<ratio>``.

Metrics (scikit-learn, the in-distribution class positive):

* ``auroc``: ``roc_auc_score(is_id, score)``;
* ``aupr``: ``average_precision_score(is_id, score)``, AUPR-In;
* ``fpr95``: the share of OOD rows whose score reaches the threshold at which 95% of the
  in-distribution rows are kept: on ``roc_curve(is_id, score)``, the false-positive rate at
  the first operating point whose true-positive rate is at least 0.95.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = [
    "OOD_LABEL",
    "OOD_KEYS",
    "SCORES",
    "OPEN_SET_METRICS",
    "auroc",
    "aupr",
    "fpr95",
    "check_ood",
    "ood_count",
    "check_disjoint",
    "mix",
    "ood_score",
    "ood_rows",
    "OWN_METRICS",
    "DECISION_METRICS",
    "own_metrics",
    "decision_metrics",
    "take_own",
]

#: The label of an out-of-distribution row (never a class index).
OOD_LABEL = -1
#: OOD scores, higher = more in-distribution.
SCORES = ("msp", "energy")
#: The keys of ``Protocol.ood`` (``dataset`` required, the rest with these defaults).
OOD_KEYS: dict[str, Any] = {
    "dataset": None,
    "dataset_args": {},
    "ratio": 0.5,
    "seed": 0,
    "score": "msp",
}
#: The metrics that need OOD rows (computed only for cells that hold both kinds).
OPEN_SET_METRICS = ("auroc", "aupr", "fpr95")


def check_ood(ood: Any, *, known_datasets: Any = None) -> dict[str, Any] | None:
    """``ood`` completed with ``OOD_KEYS``' defaults and checked, or None for None: a
    ``ValueError`` names the bad value (unknown key or score, a ratio outside (0, 1), a
    non-integer seed, no dataset, or one not in ``known_datasets`` when given)."""
    if ood is None:
        return None
    if not isinstance(ood, dict):
        raise ValueError(f"ood must be a mapping with keys {', '.join(OOD_KEYS)}, got {ood!r}")
    unknown = sorted(set(ood) - set(OOD_KEYS) - {"repeat"})
    if unknown:
        raise ValueError(f"ood: unknown key(s) {unknown}; known: {', '.join(OOD_KEYS)}")
    out = {**OOD_KEYS, **{k: v for k, v in ood.items() if v is not None}}
    out["dataset_args"] = dict(out["dataset_args"] or {})
    if not out["dataset"]:
        raise ValueError("ood: name the out-of-distribution dataset (protocol.ood_dataset=<name>)")
    if known_datasets is not None and out["dataset"] not in known_datasets:
        names = ", ".join(sorted(known_datasets))
        raise ValueError(f"ood: unknown dataset {out['dataset']!r}; available: {names}")
    ratio = out["ratio"]
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio < 1:
        raise ValueError(
            f"ood: ratio must be in (0, 1) (the OOD share of the stream), got {ratio!r}"
        )
    out["ratio"] = float(ratio)
    if isinstance(out["seed"], bool) or not isinstance(out["seed"], int):
        raise ValueError(f"ood: seed must be an integer, got {out['seed']!r}")
    if out["score"] not in SCORES:
        raise ValueError(f"ood: unknown score {out['score']!r}; available: {', '.join(SCORES)}")
    repeat = out.pop("repeat", False)
    if not isinstance(repeat, bool):
        raise ValueError(f"ood: repeat must be true or false, got {repeat!r}")
    if repeat:  # absent when false: the ids of protocols without it are unchanged
        out["repeat"] = True
    return out


def ood_count(n_id: int, ratio: float) -> int:
    """OOD rows mixed into ``n_id`` in-distribution rows for an OOD share ``ratio``."""
    return int(math.floor(ratio / (1.0 - ratio) * n_id + 0.5))


def _class_key(name: str) -> str:
    """A class name compared across datasets: case, underscores, hyphens and repeated
    spaces ignored ("Golden_Retriever" and "golden retriever" are one class)."""
    return " ".join(str(name).replace("_", " ").replace("-", " ").casefold().split())


def check_disjoint(id_stream: Any, ood_stream: Any) -> None:
    """A ``ValueError`` naming the classes the OOD set shares with the in-distribution set
    (by ``_class_key``): an "unknown" image of a known class would be scored as a detection
    failure when the model is right. Nothing when they share none."""
    known = {_class_key(c): c for c in id_stream.classnames}
    shared = sorted({known[k] for k in map(_class_key, ood_stream.classnames) if k in known})
    if shared:
        shown = ", ".join(repr(c) for c in shared[:8]) + (", ..." if len(shared) > 8 else "")
        raise ValueError(
            f"ood: {ood_stream.name!r} shares {len(shared)} class(es) with the "
            f"in-distribution set {id_stream.name!r}: {shown}. An out-of-distribution set "
            "must hold none of the known classes (choose another set, or its classes "
            "without those, e.g. through its dataset arguments)"
        )


def mix(id_stream: Any, ood_stream: Any, ood: dict[str, Any]) -> Any:
    """The ``DomainStream`` of ``id_stream`` with ``ood_count`` rows of ``ood_stream`` (a
    fixed subset drawn with ``ood["seed"]``, kept in their order) appended, labelled
    ``OOD_LABEL``; the class names and templates are ``id_stream``'s."""
    import datasets

    from tta_bench.data import DomainStream
    from tta_bench.rng import stable_seed

    check_disjoint(id_stream, ood_stream)
    n_id, n_avail = len(id_stream), len(ood_stream)
    n = ood_count(n_id, ood["ratio"])
    if n > n_avail and not ood.get("repeat"):
        raise ValueError(
            f"ood: ratio {ood['ratio']:g} needs {n} out-of-distribution images beside the "
            f"{n_id} of {id_stream.name!r}, but {ood_stream.name!r} has {n_avail}; lower "
            "protocol.ood_ratio, choose a larger OOD set, or repeat it "
            "(protocol.ood_repeat=true, as ZS-NTTA's noisy streams do)"
        )
    if n == 0:
        raise ValueError(f"ood: ratio {ood['ratio']:g} mixes no image into {n_id} images")
    rows = ood_rows(n, n_avail, stable_seed("ood", ood["dataset"], ood["seed"]) % 2**32)
    id_ds = id_stream.dataset.select_columns(["image", "label"])
    ood_ds = ood_stream.dataset.select_columns(["image"]).select(rows.tolist())
    if ood_ds.features["image"] != id_ds.features["image"]:
        try:
            ood_ds = ood_ds.cast_column("image", id_ds.features["image"])
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"ood: the images of {ood_stream.name!r} ({ood_ds.features['image']}) cannot "
                f"join those of {id_stream.name!r} ({id_ds.features['image']}): {exc}"
            ) from exc
    label_feature = datasets.Value("int64")
    bars = datasets.utils.logging.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # casts of a few columns: no "Casting the dataset" bars
    try:
        id_ds = id_ds.cast_column("label", label_feature)
        ood_ds = ood_ds.add_column("label", [OOD_LABEL] * n).cast_column("label", label_feature)
        mixed = datasets.concatenate_datasets([id_ds, ood_ds])
    finally:
        if bars:
            datasets.enable_progress_bars()
    fingerprint = f"{id_stream.fingerprint}+ood[{ood_stream.fingerprint}/n={n}/seed={ood['seed']}]"
    return DomainStream(
        name=id_stream.name,
        classnames=list(id_stream.classnames),
        templates=list(id_stream.templates),
        dataset=mixed,
        fingerprint=fingerprint,
        native_size=id_stream.native_size,
        metadata={
            **id_stream.metadata,
            "ood": {"dataset": ood_stream.name, "rows": n, "of": n_avail, "in_distribution": n_id},
        },
        open_set=True,
    )


def ood_rows(n: int, n_avail: int, seed: int) -> np.ndarray:
    """The OOD set's rows mixed in, in order: ``n`` distinct rows drawn with ``seed`` when
    the set has them; else (``repeat``) the whole set ``n // n_avail`` times, then
    ``n % n_avail`` distinct rows drawn with ``seed``, as ZS-NTTA resamples its noisy
    sets (``get_resampled_indices``)."""
    rng = np.random.default_rng(seed)
    if n <= n_avail:
        return np.sort(rng.permutation(n_avail)[:n])
    whole = np.tile(np.arange(n_avail), n // n_avail)
    return np.concatenate([whole, np.sort(rng.permutation(n_avail)[: n % n_avail])])


def ood_score(logits: Any, score: str = "msp") -> np.ndarray:
    """The OOD score of every row of ``logits`` [N, C] (float64; higher = more
    in-distribution): ``msp`` max softmax probability, ``energy`` logsumexp of the logits."""
    import torch

    if score not in SCORES:
        raise ValueError(f"unknown OOD score {score!r}; available: {', '.join(SCORES)}")
    z = torch.as_tensor(logits).double()
    if score == "msp":
        return torch.softmax(z, dim=1).max(dim=1).values.numpy()
    return torch.logsumexp(z, dim=1).numpy()


def _split(logits: Any, labels: Any, score: str) -> tuple[np.ndarray, np.ndarray]:
    is_id = _is_id(labels)
    return is_id, ood_score(logits, score)


def _is_id(labels: Any) -> np.ndarray:
    y = np.asarray(labels).reshape(-1)
    is_id = (y != OOD_LABEL).astype(np.int64)
    if is_id.all() or not is_id.any():
        raise ValueError(
            "open-set metrics need both in-distribution and OOD rows (label -1); this cell "
            f"has {int(is_id.sum())} and {int((1 - is_id).sum())}"
        )
    return is_id


def _auroc(is_id: np.ndarray, s: np.ndarray) -> float:
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(is_id, s))


def _aupr(is_id: np.ndarray, s: np.ndarray) -> float:
    from sklearn.metrics import average_precision_score

    return float(average_precision_score(is_id, s))


def _fpr95(is_id: np.ndarray, s: np.ndarray) -> float:
    from sklearn.metrics import roc_curve

    fpr, tpr, _ = roc_curve(is_id, s, drop_intermediate=False)
    return float(fpr[int(np.searchsorted(tpr, 0.95, side="left"))])


def auroc(logits: Any, labels: Any, score: str = "msp") -> float:
    """Area under the ROC curve of the OOD score, in-distribution rows positive."""
    return _auroc(*_split(logits, labels, score))


def aupr(logits: Any, labels: Any, score: str = "msp") -> float:
    """Area under the precision-recall curve (average precision), in-distribution rows
    positive (AUPR-In)."""
    return _aupr(*_split(logits, labels, score))


def fpr95(logits: Any, labels: Any, score: str = "msp") -> float:
    """False-positive rate (OOD rows kept) at the first threshold keeping >= 95% of the
    in-distribution rows."""
    return _fpr95(*_split(logits, labels, score))


for _fn in (auroc, aupr, fpr95):
    _fn.open_set = True  # type: ignore[attr-defined]


# -- a method's own score and decision (``Method.own_ood_score``) -----------------------
#: The open-set metrics of a method's own OOD score, the same definitions as above.
OWN_METRICS = ("auroc_own", "aupr_own", "fpr95_own")
#: The metrics of a method's own in/out decision (``Method.last_ood_decision``).
DECISION_METRICS = ("acc_id", "acc_ood", "acc_h")


def own_metrics(labels: Any, own: Any) -> dict[str, float]:
    """``auroc_own``, ``aupr_own`` and ``fpr95_own`` of the method's own OOD score ``own``
    ``[N]`` (higher = more in-distribution) on a cell with labels ``labels`` (-1: OOD)."""
    is_id = _is_id(labels)
    s = np.asarray(own, dtype=np.float64).reshape(-1)
    return {name: fn(is_id, s) for name, fn in zip(OWN_METRICS, (_auroc, _aupr, _fpr95))}


def decision_metrics(logits: Any, labels: Any, decision: Any) -> dict[str, float]:
    """The noisy-stream accuracies of ZS-NTTA (Cao et al., ICLR 2025) from a method's own
    in/out decision ``decision`` ``[N]`` (True = judged in-distribution):

    * ``acc_id`` (their ACC_S): the share of in-distribution rows judged in-distribution
      *and* classified correctly;
    * ``acc_ood`` (their ACC_N): the share of OOD rows judged OOD;
    * ``acc_h``: the harmonic mean of the two (0 when either is 0)."""
    is_id = _is_id(labels).astype(bool)
    y = np.asarray(labels).reshape(-1)
    keep = np.asarray(decision, dtype=bool).reshape(-1)
    pred = np.asarray(logits).argmax(axis=1)
    acc_id = float(np.mean(keep[is_id] & (pred[is_id] == y[is_id])))
    acc_ood = float(np.mean(~keep[~is_id]))
    h = 0.0 if acc_id + acc_ood == 0 else 2 * acc_id * acc_ood / (acc_id + acc_ood)
    return dict(zip(DECISION_METRICS, (acc_id, acc_ood, float(h))))


def take_own(method: Any, n: int) -> tuple[Any, Any, str | None]:
    """``(score [n] float32 or None, decision [n] bool or None, problem or None)`` of the
    batch ``method`` just returned (``Method.own_ood_score``, ``last_ood_score``,
    ``last_ood_decision``), on the CPU. ``problem`` says why the batch cannot be scored (a
    declared score not set, of another shape, or not finite): the runner reports the cell
    as failed, never scores it."""
    import torch

    if getattr(method, "own_ood_score", None) is None:
        return None, None, None
    name = type(method).__name__
    score, decision = method.last_ood_score, getattr(method, "last_ood_decision", None)
    if score is None:
        return None, None, f"{name} declares an own OOD score but set none for the batch"
    score = torch.as_tensor(score).detach().float().cpu().reshape(-1)
    if score.numel() != n:
        return None, None, f"{name}'s own OOD score has {score.numel()} values for {n} images"
    if not bool(torch.isfinite(score).all()):
        return None, None, "non-finite own OOD score"
    if decision is not None:
        decision = torch.as_tensor(decision).detach().cpu().reshape(-1).bool()
        if decision.numel() != n:
            return None, None, f"{name}'s OOD decision has {decision.numel()} values for {n} images"
    return score, decision, None
