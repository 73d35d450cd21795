"""Every registered shift kernel with recycled batch buffers (``tta_bench.buffers``): a
result still held is never written over by the next call, and a call on recycled buffers
gives the values of a first call, bit for bit."""

from __future__ import annotations

import pytest
import torch

from tta_bench import buffers
from tta_bench.registry import registry
from tta_bench.rng import SampleGenerator
from tta_bench.run.composite import apply_shift, shift_kernel

SHIFTS = sorted(registry("shifts").names())


def _images(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(4, 224, 224, 3, generator=g) * 255).to(torch.uint8)  # 2.4 MB as float


def _corrupt(name: str, images: torch.Tensor) -> torch.Tensor:
    gen = SampleGenerator.for_samples(range(len(images)), 0, name, 3)
    return apply_shift(shift_kernel(name), images, 3, gen, "imagenet")


@pytest.mark.parametrize("name", SHIFTS)
def test_held_results_survive_the_next_call(name):
    _corrupt(name, _images(2))  # first-call state (imports, tables) out of the way
    buffers.release()
    reused = buffers.stats()["reused"]
    first = _corrupt(name, _images(0))
    kept = first.clone()
    second = _corrupt(name, _images(1))  # buffers of the first call that are free again
    assert torch.equal(first, kept)
    assert first.data_ptr() != second.data_ptr()
    del first, second
    assert torch.equal(_corrupt(name, _images(0)), kept)  # on recycled buffers
    assert buffers.stats()["reused"] > reused  # the batch-sized blocks came from the pool
