"""The shared frozen backbone of standalone adapters (``SharedBackbone``): one classifier
that any number of method instances adapt at once, each over its own copies of only the
tensors its method changes.

A ``SharedBackbone`` builds the method once on a throw-away copy (the *probe*) and learns
which tensors of the classifier it changes: the base parameters it declares trainable
(Tent's LayerNorm affines) or leaves requiring grad, and any base parameter or buffer whose
value moves during ``setup()`` and two adaptation steps. Every other tensor is shared: each
instance's method is built over a ``copy.deepcopy`` of the classifier whose memo maps every
shared tensor to itself (every classifier copy shares the stateless tokenizer), then
``setup()``. An instance therefore owns only its module structure, its copies of the
adapted tensors, and the method's own state (adapters, router, optimiser, snapshot,
caches); ``owned_bytes()`` measures it. Shared tensors keep ``requires_grad=False``, so
concurrent instances in different threads never write them: a method's ``reset()`` writes
back only the buffers whose values moved, never a shared one, whose version counter a
concurrent backward may have saved.

``setup()`` runs under a forked, seeded global RNG (the runner's seed
``stable_seed(method, "setup", seed)``; a lock serialises setups across threads, and the
caller's RNG state is left as it was).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from tta_bench.method import Method
from tta_bench.model import ZeroShotClassifier
from tta_bench.registry import registry
from tta_bench.rng import stable_seed

__all__ = ["ArgumentError", "SharedBackbone", "check_seed", "default_method", "name_or_none"]

_SETUP_LOCK = threading.Lock()
#: The seeds ``torch.Generator.manual_seed`` takes.
_SEED_RANGE = (-(2**63), 2**64 - 1)


class ArgumentError(ValueError, TypeError):
    """An argument of the wrong type: a ``ValueError`` (bad input, as the docs promise and
    the CLI's exit 2 catches) and a ``TypeError`` (what Python raises for a wrong type)."""


def name_or_none(value: Any, argument: str, what: str) -> str | None:
    """``value`` when it is a string or None; else an ``ArgumentError`` naming
    ``argument`` and ``what`` it names (``"a registered method"``)."""
    if value is None or isinstance(value, str):
        return value
    raise ArgumentError(
        f"{argument} must be the name of {what} (a string) or None for the catalogues' "
        f"default, got {type(value).__name__} {value!r}"
    )


def check_seed(seed: Any, argument: str = "seed") -> int:
    """``seed`` as an ``int``: an integer (numpy's too; not a bool) that torch takes,
    ``-2**63 .. 2**64 - 1``; else an ``ArgumentError`` naming ``argument``."""
    ok = isinstance(seed, (int, np.integer)) and not isinstance(seed, (bool, np.bool_))
    if not ok or not _SEED_RANGE[0] <= int(seed) <= _SEED_RANGE[1]:
        raise ArgumentError(
            f"{argument} must be an integer in [-2**63, 2**64 - 1], got {seed!r}"
            + (f" ({type(seed).__name__})" if not ok else "")
        )
    return int(seed)


def default_method(method: str | None) -> str:
    """``method``, or the catalogues' default method (``defaults: method``) when None; an
    ``ArgumentError`` when it is neither a string nor None."""
    from tta_bench import catalog

    method = name_or_none(method, "method", "a registered method (tta-bench ls methods)")
    return method if method is not None else catalog.default("method")


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


def _storages(obj: Any, skip: set[int]) -> dict[tuple[str, int], int]:
    """Bytes of every tensor storage reachable from ``obj`` (modules, dicts, sequences,
    optimisers, plain objects' attributes), keyed by storage; objects in ``skip`` (by id)
    are not entered."""
    out: dict[tuple[str, int], int] = {}
    seen: set[int] = set(skip)
    stack = [obj]
    while stack:
        o = stack.pop()
        if id(o) in seen or o is None or isinstance(o, (str, bytes, int, float, bool)):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            if o.layout == torch.strided and o.numel():
                st = o.untyped_storage()
                out[_storage_key(o)] = max(out.get(_storage_key(o), 0), st.nbytes())
            continue
        if isinstance(o, torch.optim.Optimizer):
            stack.extend([o.state, o.param_groups])
        elif isinstance(o, Mapping):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        elif isinstance(o, (torch.Generator, torch.device, torch.dtype, type)) or callable(o):
            if isinstance(o, nn.Module):
                stack.append(vars(o))
        elif hasattr(o, "__dict__"):
            stack.append(vars(o))
    return out


class SharedBackbone:
    """One frozen classifier that any number of method instances adapt concurrently, each
    over its own copies of only the tensors that method changes (module docstring).

    ``instantiate()`` returns a set-up method instance; ``adapted`` names the classifier
    tensors every instance copies; ``shared_bytes`` is the size of the rest."""

    def __init__(
        self,
        model: ZeroShotClassifier,
        method: str | None = None,
        config: Any = None,
        *,
        seed: int = 0,
        source_images: torch.Tensor | None = None,
    ):
        self.model = model.eval()
        method = default_method(method)
        self.method_name = method
        self.method_cls = registry("methods").get(method)
        self.config = config if config is not None else self.method_cls.Config()
        self.seed = check_seed(seed)
        self.source_images = source_images
        for p in model.parameters():
            p.requires_grad_(False)
        self.adapted: list[str] = self._probe()
        shared = [(n, t) for n, t in _named_tensors(model) if n not in set(self.adapted)]
        self._memo: dict[int, Any] = {id(t): t for _, t in shared}
        self._shared_storages = {_storage_key(t) for _, t in shared if t.numel()}
        every = {_storage_key(t): t.untyped_storage().nbytes() for _, t in _named_tensors(model)}
        #: Bytes of the classifier's tensors: what a whole-model copy per adapter would cost.
        self.model_bytes = sum(every.values())
        #: Bytes of the tensors all adapters share.
        self.shared_bytes = sum(n for k, n in every.items() if k in self._shared_storages)

    @property
    def device(self) -> torch.device:
        return self.model.mean.device

    def _build(self, model: ZeroShotClassifier) -> Method:
        method = self.method_cls(model, copy.deepcopy(self.config))
        needed = method.source_images_needed()
        if needed:  # e.g. EATA's Fisher information; fewer images than asked: all of them
            method.set_source(*self._source(needed, method.needs_source_labels))
        cuda = [self.device] if self.device.type == "cuda" else []
        seed = stable_seed(self.method_name, "setup", self.seed) % 2**63
        with _SETUP_LOCK, torch.random.fork_rng(devices=cuda):
            torch.manual_seed(seed)
            method.setup()
        return method

    def _source(self, needed: int, with_labels: bool) -> tuple[torch.Tensor, ...]:
        """``(images,)`` or, for a method that ``needs_source_labels``, ``(images, labels)``
        from ``source_images`` (a tensor, or an ``(images, labels)`` pair), the first
        ``needed`` of them; ValueError naming what is missing."""
        src = self.source_images
        labels = None
        if isinstance(src, (tuple, list)):
            if len(src) != 2:
                raise ValueError(
                    "source_images is a tensor [N, 3, H, W] or a pair (images, labels [N]); "
                    f"got a sequence of {len(src)}"
                )
            src, labels = src
        if src is None or not len(src):
            kind = "labelled" if with_labels else "unlabeled"
            raise ValueError(
                f"method {self.method_name!r} needs clean, {kind} source images before "
                f"setup (up to {needed}); pass source_images=[N, 3, H, W] in [0, 1]"
                + (" with their labels: source_images=(images, labels [N])" if with_labels else "")
            )
        if not with_labels:
            return (src[:needed].to(self.device),)
        if labels is None or len(labels) != len(src):
            raise ValueError(
                f"method {self.method_name!r} needs the labels of its source images: pass "
                f"source_images=(images [N, 3, H, W], labels [N]); got "
                + ("no labels" if labels is None else f"{len(labels)} labels for {len(src)} images")
            )
        labels = torch.as_tensor(labels, dtype=torch.int64)
        return src[:needed].to(self.device), labels[:needed].to(self.device)

    def _probe(self) -> list[str]:
        """Names of the classifier's tensors the method changes (see the module docstring)."""
        probe_model = copy.deepcopy(self.model)
        before = _named_tensors(probe_model)
        method = self._build(probe_model)
        trainable = {id(p) for p in method.trainable_parameters()}
        size = self.model.preprocess.image_size
        gen = torch.Generator().manual_seed(0)
        x = torch.rand(2, 3, size, size, generator=gen).to(self.device)
        for seed in (0, 1):
            method.reseed(seed)
            method.step(x)
        base = dict(_named_tensors(self.model))
        changed = set()
        for name, t in before:
            # declared trainable, moved in value, or left requiring grad (a backward through
            # it would write .grad into a tensor every adapter shares)
            if id(t) in trainable or t.requires_grad or not torch.equal(t.detach(), base[name]):
                changed.add(name)
        return sorted(changed)

    def instantiate(self) -> Method:
        """A set-up method over a classifier copy that shares every frozen tensor."""
        model = copy.deepcopy(self.model, memo=dict(self._memo))
        return self._build(model)

    def owned_bytes(self, method: Method) -> int:
        """Bytes of the tensor storages ``method`` holds that the backbone does not share."""
        found = _storages(method, {id(self.model.tokenizer)})
        return sum(n for k, n in found.items() if k not in self._shared_storages)
