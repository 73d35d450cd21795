"""Deterministic, per-sample randomness.

Every random draw that touches a test sample is seeded from a stable key such as
``(seed, shift, severity, sample_index)``, so a sample's corruption does not depend on the
batch size, the batch order, the number of workers or the process.

Shift kernels receive a ``SampleGenerator``: one ``torch.Generator`` per sample in the batch,
with helpers that draw a tensor per sample and stack them (row ``i`` comes from sample ``i``'s
generator only).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import torch


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from any printable parts; identical across processes and machines."""
    text = "\x1f".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def stable_seeds(key: Sequence[object], indices: Iterable[int]) -> list[int]:
    """``[stable_seed(*key, i) for i in indices]``, hashing the shared prefix once (a copy
    of the prefix's hash state per index: the same digests, ~2x cheaper per sample)."""
    prefix = hashlib.blake2b(digest_size=8)
    prefix.update(("\x1f".join(str(p) for p in key) + "\x1f").encode() if key else b"")
    out = []
    for i in indices:
        h = prefix.copy()
        h.update(str(int(i)).encode())
        out.append(int.from_bytes(h.digest(), "little") >> 1)
    return out


class GeneratorPool:
    """Reusable ``torch.Generator`` objects for ``SampleGenerator``s whose end the caller
    knows (the runner: one per batch, released after the kernel). ``manual_seed`` resets a
    CPU generator's whole state, so a reused generator draws exactly what a new one would;
    constructing 64 generators per batch was a visible share of a small batch's shift."""

    def __init__(self) -> None:
        self._free: list[torch.Generator] = []

    def take(self, seeds: Sequence[int]) -> list[torch.Generator]:
        out = []
        for s in seeds:
            g = self._free.pop() if self._free else torch.Generator()
            out.append(g.manual_seed(s))
        return out

    def give_back(self, generators: Iterable[torch.Generator]) -> None:
        self._free.extend(generators)


class SampleGenerator:
    """Per-sample generators for one batch.

    ``seeds[i]`` seeds sample ``i``. Draws are made on the CPU (so values are identical on
    every device) and moved to ``device``.
    """

    def __init__(
        self,
        seeds: Sequence[int],
        device: torch.device | str = "cpu",
        pool: GeneratorPool | None = None,
    ):
        self.seeds = [int(s) for s in seeds]
        self.device = torch.device(device)
        self._pool = pool
        self._generators: list[torch.Generator] | None = None
        self._released = False

    @property
    def generators(self) -> list[torch.Generator]:
        """One ``torch.Generator`` per sample, seeded with ``seeds[i]``. Built on first use:
        deterministic kernels never draw, and the construction is a noticeable share of a
        small batch's corruption time."""
        if self._generators is None:
            if self._released:
                raise RuntimeError("SampleGenerator used after release()")
            if self._pool is not None:
                self._generators = self._pool.take(self.seeds)
            else:
                self._generators = [torch.Generator().manual_seed(s) for s in self.seeds]
        return self._generators

    def release(self) -> None:
        """Hand the generators back to the pool; this object draws nothing afterwards."""
        self._released = True
        if self._pool is not None and self._generators is not None:
            self._pool.give_back(self._generators)
        self._generators = None

    @classmethod
    def for_samples(
        cls,
        indices: Sequence[int],
        *key: object,
        device: torch.device | str = "cpu",
        pool: GeneratorPool | None = None,
    ) -> SampleGenerator:
        """Generators for dataset ``indices`` under ``key`` (e.g. seed, shift, severity):
        sample ``i`` is seeded with ``stable_seed(*key, i)``."""
        return cls(stable_seeds(key, indices), device=device, pool=pool)

    def __len__(self) -> int:
        return len(self.seeds)

    def subset(self, start: int, stop: int) -> SampleGenerator:
        """The generators of samples ``start:stop``, shared (not copies): a kernel that runs
        a batch a few samples at a time draws from each sample's own generator exactly what
        the whole batch would. The pool, if any, stays with this object (``release``)."""
        part = SampleGenerator(self.seeds[start:stop], device=self.device)
        part._generators = self.generators[start:stop]
        return part

    def _stack(self, draw, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        rows = [draw(tuple(shape), g, dtype) for g in self.generators]
        return torch.stack(rows).to(self.device)

    def normal(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[B, *shape]`` standard-normal draws."""
        return self._stack(lambda s, g, d: torch.randn(s, generator=g, dtype=d), shape, dtype)

    def uniform(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[B, *shape]`` draws from U[0, 1)."""
        return self._stack(lambda s, g, d: torch.rand(s, generator=g, dtype=d), shape, dtype)

    def randint(self, low: int, high: int, *shape: int) -> torch.Tensor:
        """``[B, *shape]`` integers in ``[low, high)``."""
        return self._stack(
            lambda s, g, d: torch.randint(low, high, s, generator=g, dtype=d), shape, torch.int64
        )

    def poisson(self, rates: torch.Tensor) -> torch.Tensor:
        """Poisson draws with per-sample ``rates[B, ...]``."""
        rows = [torch.poisson(r.cpu().float(), generator=g) for r, g in zip(rates, self.generators)]
        return torch.stack(rows).to(self.device)
