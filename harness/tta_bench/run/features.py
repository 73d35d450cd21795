"""Image features encoded once per run and replayed to every stream order.

A protocol with ``orders`` (``Protocol.orders``) runs N orders of the same corrupted images:
the shift noise is seeded by ``Protocol.noise_seed``, not by the order, so image ``i`` of
domain ``(shift, severity)`` is the same tensor in every order. A method that reads its
images only through their features (``Method.features_only``: zero-shot, TDA, OnZeta, ECALP
in their single-view settings) then needs each image's features once: ``FeatureStore.fill``
decodes, corrupts and encodes every image of every domain once, in index order and in
chunks of the protocol's batch size, and the runner replays the features of each batch of
each order to ``Method.step_features``, without the loader, the shift kernels or the image
tower.

Results are identical to encoding each batch as the stream meets it (tested, bit for bit)
because the image tower encodes every row of a batch independently of the other rows. One
exception is known: a batch of a single row goes through a matrix-vector kernel that rounds
differently, so a chunk of one row is never made (a trailing single row joins the chunk
before it), and a protocol with batch size 1 encodes one image per chunk, as its stream
does. A stream batch of a single row in a protocol with larger batches (a cell whose size
is one more than a multiple of the batch size) may differ from its uncached twin in the last
bits of its features; a test names the policy that would meet it.

The store lives in memory for the run (features of ``D`` floats per image and domain: 15
domains of 10,000 images at ``D = 512`` are 300 MB).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from tta_bench.run.stream import Batch, Domain, Stream, subset

#: ``feature_cache`` policies: ``auto`` (on with ``protocol.orders`` for a feature-only
#: method) or ``never`` (encode every batch of every order).
FEATURE_CACHE_POLICIES = ("auto", "never")


def chunks(indices: np.ndarray, batch_size: int) -> list[np.ndarray]:
    """``indices`` cut into chunks of ``batch_size``; with ``batch_size > 1`` a trailing
    single row joins the chunk before it (a one-row batch is encoded by another kernel)."""
    parts = [indices[k : k + batch_size] for k in range(0, len(indices), batch_size)]
    if batch_size > 1 and len(parts) > 1 and len(parts[-1]) == 1:
        parts[-2:] = [np.concatenate(parts[-2:])]
    return parts


class FeatureStore:
    """The float32, L2-normalised image features (``ZeroShotClassifier.encode_image``) of
    every image of every domain of a run, and the rows whose images could not be decoded."""

    def __init__(self) -> None:
        self._rows: dict[Domain, np.ndarray] = {}  # dataset index -> row (-1: none)
        self._feats: dict[Domain, torch.Tensor] = {}
        #: Images encoded, and seconds spent on it (``fill``).
        self.encoded = 0
        self.seconds = 0.0

    def fill(self, inputs: Any, noise_seed: int, timer: Any, progress: bool = False) -> None:
        """Decode, corrupt (shift noise seeded by ``noise_seed``) and encode every image of
        every domain of ``inputs`` once, in index order."""
        from tqdm.auto import tqdm

        protocol = inputs.protocol
        domains = tuple(inputs.domains)
        plan: list[Batch] = []
        for d, dom in enumerate(domains):
            idx = subset(protocol, len(inputs.labels[dom]))
            for part in chunks(idx, protocol.batch_size):
                dom_ids = np.full(len(part), d, dtype=np.int64)
                plan.append(Batch(len(plan), part, dom_ids, False, 0))
        stream = Stream(noise_seed, domains, ((),), tuple(plan))
        start = time.perf_counter()
        loaded = iter(inputs.loader(plan, noise_seed))
        parts: dict[Domain, list[tuple[np.ndarray, torch.Tensor]]] = {d: [] for d in domains}
        for batch in tqdm(plan, desc="encoding images once", unit="batch", disable=not progress):
            x, _y, kept = inputs.prepare(next(loaded), batch, stream, noise_seed, timer)
            if len(kept) == 0:
                continue
            dom = domains[int(kept.domains[0])]
            with torch.no_grad():
                feats = inputs.base(dom).encode_image(x).float()
            parts[dom].append((kept.indices, feats))
            self.encoded += len(kept)
        for dom, got in parts.items():
            rows = np.full(len(inputs.labels[dom]), -1, dtype=np.int64)
            if got:
                index = np.concatenate([i for i, _ in got])
                rows[index] = np.arange(len(index))
                self._feats[dom] = torch.cat([f for _, f in got])
            self._rows[dom] = rows
        self.seconds += time.perf_counter() - start

    def take(
        self, batch: Batch, stream: Stream, labels: dict[Domain, np.ndarray], device: Any
    ) -> tuple[torch.Tensor, torch.Tensor, Batch]:
        """``(features [B, D], labels [B], the batch's kept rows)`` of ``batch``: the rows
        whose images could not be decoded when the store was filled are left out."""
        doms = [stream.domains[int(d)] for d in batch.domains]
        rows = np.array([self._rows[d][i] for d, i in zip(doms, batch.indices.tolist())])
        kept = np.flatnonzero(rows >= 0)
        if len(kept) != len(batch):
            batch = Batch(
                batch.number,
                batch.indices[kept],
                batch.domains[kept],
                batch.reset_before,
                batch.group,
            )
            doms = [doms[k] for k in kept]
            rows = rows[kept]
        if len(batch) == 0:
            return torch.empty(0), torch.empty(0, dtype=torch.long), batch
        single = batch.single_domain()
        if single is not None:
            feats = self._feats[doms[0]][torch.from_numpy(rows)]
        else:
            feats = torch.stack([self._feats[d][int(r)] for d, r in zip(doms, rows)])
        y = np.array([labels[d][i] for d, i in zip(doms, batch.indices.tolist())])
        return feats.to(device), torch.as_tensor(y, dtype=torch.long, device=device), batch
