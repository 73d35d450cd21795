"""Recycled batch buffers (``tta_bench.buffers``): a buffer is handed out again only when
nothing else refers to it, and a run leaves the process's allocator as it found it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tta_bench import buffers

SHAPE = (8, 3, 128, 128)  # 1.5 MiB of float32: above MIN_BYTES


@pytest.fixture(autouse=True)
def _empty_pool():
    buffers.release()
    yield
    buffers.release()


def test_free_buffer_is_reused():
    a = buffers.batch_buffer(SHAPE)
    ptr = a.data_ptr()
    del a
    assert buffers.batch_buffer(SHAPE).data_ptr() == ptr


def test_buffer_in_use_is_never_handed_out():
    a = buffers.batch_buffer(SHAPE)
    a.fill_(1.0)
    b = buffers.batch_buffer(SHAPE)
    assert b.data_ptr() != a.data_ptr()
    b.fill_(2.0)
    assert bool((a == 1.0).all())


def test_a_view_or_numpy_array_keeps_it():
    a = buffers.batch_buffer(SHAPE)
    ptr = a.data_ptr()
    kept = a[1]  # a memory bank keeping one image of the batch
    del a
    assert buffers.batch_buffer(SHAPE).data_ptr() != ptr
    del kept
    a = buffers.batch_buffer(SHAPE)
    arr = a.numpy()
    del a
    assert buffers.batch_buffer(SHAPE).data_ptr() != arr.ctypes.data
    del arr
    # a tensor saved for backward (autograd holds its storage)
    a = buffers.batch_buffer(SHAPE)
    ptr = a.data_ptr()
    w = torch.ones(1, requires_grad=True)
    y = (a * w).sum()
    del a
    assert buffers.batch_buffer(SHAPE).data_ptr() != ptr
    del y


def test_leaf_requiring_grad_is_dropped():
    a = buffers.batch_buffer(SHAPE)
    a.requires_grad_(True)
    del a
    new = buffers.stats()["new"]
    b = buffers.batch_buffer(SHAPE)
    assert not b.requires_grad and buffers.stats()["new"] == new + 1  # not the leaf


def test_inference_tensors_are_their_own_pool():
    with torch.inference_mode():
        a = buffers.batch_buffer(SHAPE)
        assert a.is_inference()
    del a
    b = buffers.batch_buffer(SHAPE)
    assert not b.is_inference()
    b.add_(1.0)  # an in-place update outside inference mode works


def test_small_requests_are_plain():
    small = buffers.batch_buffer((2, 3))
    assert small.shape == (2, 3) and buffers.stats()["held_bytes"] == 0
    assert SHAPE[0] * SHAPE[1] * SHAPE[2] * SHAPE[3] * 4 >= buffers.MIN_BYTES  # the others pool


def test_pool_is_bounded(monkeypatch):
    monkeypatch.setattr(buffers, "MAX_BYTES", 3 * (8 * 3 * 128 * 128 * 4))
    held = [buffers.batch_buffer(SHAPE) for _ in range(5)]
    assert 0 < buffers.stats()["held_bytes"] <= buffers.MAX_BYTES
    del held


def test_channels_last_buffers():
    a = buffers.batch_buffer(SHAPE, memory_format=torch.channels_last)
    assert a.is_contiguous(memory_format=torch.channels_last)


def test_no_process_wide_allocator_policy():
    """Nothing in the harness changes the C library's allocator settings (a user's program
    calling ``tta_bench.evaluate()`` keeps its own)."""
    import tta_bench

    root = Path(tta_bench.__file__).parent
    offenders = [
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if "mallopt" in p.read_text() or "MALLOC_MMAP" in p.read_text()
    ]
    assert offenders == []


def test_buffer_like_is_a_recycled_empty_like():
    t = torch.zeros(SHAPE, dtype=torch.float64)
    a = buffers.buffer_like(t)
    assert (a.shape, a.dtype, a.device) == (t.shape, t.dtype, t.device)
    ptr = a.data_ptr()
    del a
    b = buffers.buffer_like(t)
    assert b.data_ptr() == ptr
    assert buffers.buffer_like(t, torch.bool).dtype == torch.bool
